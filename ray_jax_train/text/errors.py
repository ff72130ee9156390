"""Errors for the text pipeline.

All are ``ValueError`` subclasses so callers that already catch bad-input ``ValueError`` keep working,
while tests and users can catch the specific problem.
"""


class TextDataError(ValueError):
    """Base class: the input data or tokenizer cannot be turned into training sequences."""


class MissingColumnError(TextDataError):
    """Neither the text column nor the messages column exists."""


class EmptyDatasetError(TextDataError):
    """The dataset (or the path it was read from) holds no rows."""


class SequenceTooLongError(TextDataError):
    """A document is longer than the model's position table and truncation is off."""


class NoChatTemplateError(TextDataError):
    """Chat messages were given to a tokenizer that cannot render them."""

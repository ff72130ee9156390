"""Errors for the text pipeline.

All are ``ValueError`` subclasses so callers that already catch bad-input ``ValueError`` keep working,
while tests and users can catch the specific problem.
"""
import re


class TextDataError(ValueError):
    """Base class: the input data or tokenizer cannot be turned into training sequences."""

    retry_repeats_it = True  # FailureConfig does not retry it (ray_jax_train.retries)


class MissingColumnError(TextDataError):
    """Neither the text column nor the messages column exists."""


class EmptyDatasetError(TextDataError):
    """The dataset (or the path it was read from) holds no rows."""

    retry_repeats_it = False  # "no files found" may be a shared mount not up yet on a worker's node


class SequenceTooLongError(TextDataError):
    """A document is longer than the model's position table and truncation is off."""


class NoChatTemplateError(TextDataError):
    """Chat messages were given to a tokenizer that cannot render them."""


_RAISED_LINE = re.compile(r"^((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.+)$")


def read_error(exc: BaseException) -> str:
    """What went wrong in a Ray Data task (reading or tokenising), without Ray's traceback around it: its last line
    names the cause. A file that does not parse as its extension says gets the formats named."""
    import ray.exceptions

    if not isinstance(exc, ray.exceptions.RayTaskError):
        return str(exc)
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    cause = lines[-1] if lines else type(exc).__name__
    # A map UDF's error comes wrapped in Ray Data's UserCodeException, whose last lines are its retry advice: the
    # user's error is the last raised line that is not Ray's own.
    raised = [m for m in map(_RAISED_LINE.match, lines)
              if m and not any(ray_own in m.group(1) for ray_own in ("UserCodeException", "RayTaskError"))]
    if raised:  # our own errors' messages say it all; another's type is part of what it says (UnicodeDecodeError)
        kind, message = raised[-1].groups()
        cause = message if kind.startswith("ray_jax_train.") else f"{kind.rsplit('.', 1)[-1]}: {message}"
    if any(word in cause.lower() for word in ("decod", "json", "pars", "arrowinvalid", "unmatched")):
        cause += (". Check that every file is UTF-8 text (.txt: one document per line), JSON lines (.jsonl: one JSON "
                  "object per line), Parquet or CSV, as its extension says")
    return cause

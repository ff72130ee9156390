"""Errors in how the library is called: an argument, a state or a rule that cannot work as written.

The same loop makes the same call on every attempt, so FailureConfig does not retry them (ray_jax_train.retries):
a loop that reported, then saved a state it had not placed on the mesh, restarted its workers `max_failures`
times, and forever with `max_failures=-1`. They are raised as the ValueError or TypeError they always were.
Stdlib only: the mesh module, imported by every worker, raises them.
"""


class UsageError(Exception):
    """A call into the library that cannot work as written; its message names the fix."""

    retry_repeats_it = True  # FailureConfig does not retry it (ray_jax_train.retries)


class UsageValueError(UsageError, ValueError):
    """A value that does not fit: a mesh that does not divide the devices, a state not on the mesh, a rule."""


class UsageTypeError(UsageError, TypeError):
    """An argument or a state leaf of a kind the call cannot take."""

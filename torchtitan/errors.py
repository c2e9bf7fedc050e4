"""The one exception type for mistakes a user can fix (bad config, missing file, bad option).

``train.py``, ``estimation.py`` and the other entry points print it as a single line and exit with
code 2; everything else is an internal bug and keeps its traceback.
"""


class UserError(ValueError):
    """A problem in the user's input, with a message that names the problem and the fix."""

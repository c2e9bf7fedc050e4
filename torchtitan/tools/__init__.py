"""Command-line tools that work on the outputs of training runs (``python -m torchtitan.tools.<name>``)."""

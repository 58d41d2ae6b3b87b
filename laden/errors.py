"""Errors that end a run with a message and an exit status instead of a traceback (imports nothing)."""


class RunFailedError(RuntimeError):
    """A run stopped for a reason its message states in full (the CLI prints it, exits 1, no traceback)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lines = [message]

    def note(self, line: str) -> None:
        """Add a line to the message (what was saved, how to go on)."""
        self.lines.append(line)

    def __str__(self) -> str:
        return "\n".join(self.lines)


class RewardFailureError(RunFailedError):
    """More than `reward_error_tolerance` of a `laden rl` step's rewards failed; the message has the first error."""

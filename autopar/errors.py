"""The errors autopar raises for bad input. Each message names the cause (expected vs got) and the fix.

All derive from ``AutoparError``, itself a ``ValueError``: they are about what the user passed in.
Internal invariants use ``assert`` instead.
"""


class AutoparError(ValueError):
    """Base class of every user-facing autopar error."""


class CaptureError(AutoparError):
    """The model could not be captured as a graph by torch.export."""


class ClusterError(AutoparError):
    """A cluster description is malformed or does not match the running process group."""


class PlanError(AutoparError):
    """A plan is malformed, or belongs to another model, inputs or cluster."""


class OptionError(PlanError):
    """A planner or compile option has an unknown name, a value of the wrong type, or a value it cannot take."""


class InfeasibleError(AutoparError):
    """No plan fits the per-device memory budget."""


def budget_unit_hint(budget: float) -> str:
    """" Note ..." when a budget of at most 4096 bytes per device looks like GiB given where bytes are
    expected (no device has 4 TiB, and no model trains in 4 KiB); else ""."""
    if budget > 4096:
        return ""
    return (f" Note that memory_per_device is in bytes: {budget:g} looks like a count of GiB, which would be "
            f"memory_per_device={budget:g} * 2**30.")


class InputError(AutoparError):
    """Inputs passed at run time differ from the example inputs the plan was made for."""


class PrecisionError(AutoparError):
    """An unknown precision policy, or one the device cannot run."""


class CommunicationError(RuntimeError):
    """A collective failed or timed out, typically because another rank died; ``dead_ranks`` names the peers
    found dead or failed (empty when none was found: a peer may be stuck)."""

    dead_ranks: list = []


class UsageError(AutoparError):
    """An autopar function was called the wrong way (an argument it cannot use, calls out of order)."""


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete, or was saved from another model."""


class LaunchError(CommunicationError):
    """A rank of ``autopar.launch`` died or failed; ``dead_ranks`` and ``rank_errors`` say which and why."""

    dead_ranks: list = []
    rank_errors: dict = {}


class IndexRangeError(InputError, IndexError):
    """A token id or class target is out of range (an ``IndexError``, as one device raises); caught on
    the global batch before a vocabulary- or batch-split layout could hide it or stop one rank alone."""

"""One exception hierarchy for the whole project.

Catch ``FlowSpecError`` at task boundaries; raise the narrowest subclass that says what went wrong and,
where possible, what the user can do about it.
"""


class FlowSpecError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(FlowSpecError):
    """A setting, flag or file the user gave is invalid."""


class UnsupportedModel(FlowSpecError):
    """The checkpoint's architecture or tensor layout is not one we can run."""


class WeightsError(FlowSpecError):
    """A tensor is missing, has the wrong shape, or does not match its fingerprint."""


class ContextOverflow(FlowSpecError):
    """A request needs more positions than the KV cache or the model allows."""


class ProtocolError(FlowSpecError):
    """A peer sent a frame or message that fails validation."""


class ForwardStopped(FlowSpecError):
    """A stage stopped a forward between two layers because a queued prune discards every node in it (internal:
    the stage marks the rows dead and passes the forward on)."""


class PeerGone(FlowSpecError):
    """A peer's link closed or it stopped answering."""


class LinkLost(PeerGone):
    """A stage lost its inbound link while it held this request's state (it says so with a StageError)."""


class PlanInfeasible(FlowSpecError):
    """No assignment of layers to the available devices fits their memory. ``short_bytes``: how much memory is
    missing (planner.shortfall), where the planner could tell."""

    def __init__(self, message: str, *, short_bytes: int | None = None):
        super().__init__(message)
        self.short_bytes = short_bytes


class NotReady(FlowSpecError):
    """The cluster is (re-)planning or loading and cannot serve yet."""


class StageFailed(FlowSpecError):
    """A pipeline stage could not apply a message of this request (it reported a StageError)."""


class Busy(FlowSpecError):
    """Too many requests are waiting for their turn; try again later."""


class DeadlineReached(FlowSpecError):
    """A request's own deadline passed while it decoded: its reply ends with what it has (finish reason length)."""


class InvalidRequest(FlowSpecError):
    """A request the client must fix: unknown decoding mode, bad parameters."""

"""What the scheduler hands the runner for one engine step (data only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.requests import ChunkRequest


@dataclass(frozen=True)
class ScheduledChunk:
    """One stream's chunk in this step's batch."""

    stream_id: str
    request: ChunkRequest  # the request this chunk serves (its actions or action source)
    n_latent: int  # latent frames this chunk adds
    waited_s: float | None = None  # submit -> this batch, seconds; None if it ran before (requeued)


@dataclass
class StepPlan:
    """One batch: chunks that share a model and a shape, plus streams the runner may forget."""

    model_id: str = ""  # every chunk in the batch runs on this world
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_stream_ids: list[str] = field(default_factory=list)  # streams removed since the last step

    @staticmethod
    def make_empty() -> StepPlan:
        """A plan that runs nothing."""
        return StepPlan()

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run or free."""
        return not self.chunks and not self.finished_stream_ids

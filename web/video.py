"""Write frames to an MP4 file (H.264 via PyAV): the CLI's one-shot output."""

from fractions import Fraction
from pathlib import Path
from types import TracebackType

import av
import numpy as np

__all__ = ["Mp4Writer"]


class Mp4Writer:
    """An MP4 file being written, one (T, H, W, 3) uint8 chunk at a time."""

    def __init__(self, path: str | Path, width: int, height: int, fps: float, crf: int = 18) -> None:
        self.path = Path(path)
        self.frames = 0  # frames written so far
        self._container = av.open(str(self.path), "w")
        self._stream = self._container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        self._stream.width = width
        self._stream.height = height
        self._stream.pix_fmt = "yuv420p"
        self._stream.options = {"preset": "veryfast", "crf": str(crf)}

    def write(self, frames: np.ndarray) -> None:
        """Append frames, (T, H, W, 3) uint8 RGB."""
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            self._container.mux(self._stream.encode(frame))
            self.frames += 1

    def close(self) -> None:
        """Flush the encoder and finish the file."""
        self._container.mux(self._stream.encode(None))
        self._container.close()

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

"""Byte-level text: the Python standard library's sources, or any text.

Files are read in sorted order; every ``val_every``-th file is held out for
validation. A batch is a deterministic function of ``(seed, step)``, so the
data position of a run is its step count and a resumed run sees exactly the
batches an uninterrupted one would.
"""

import hashlib
import os
import pathlib
import platform
import sysconfig

import numpy as np

_SKIPPED_FOLDERS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_path() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def text_files(path: pathlib.Path) -> list[pathlib.Path]:
  """One file, or every ``.py``/``.txt``/``.md`` file below a folder, sorted."""
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"data path {str(path)!r} does not exist")
  if path.is_file():
    return [path]
  files = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_FOLDERS)
    files += [
      pathlib.Path(root, n) for n in names if n.endswith((".py", ".txt", ".md"))
    ]
  files.sort()
  if not files:
    raise ValueError(f"data path {str(path)!r} holds no .py, .txt or .md files")
  return files


class ByteCorpus:
  """Train and validation byte arrays with deterministic batches."""

  def __init__(
    self, path=None, *, max_bytes: int = 8_000_000, val_every: int = 10
  ):
    files = text_files(path or stdlib_path())
    train, val, size = [], [], 0
    for i, file in enumerate(files):
      data = file.read_bytes()
      if len(files) == 1:  # one file: its last tenth is validation
        cut = len(data) - len(data) // val_every
        train.append(data[:cut]), val.append(data[cut:])
      else:
        (val if i % val_every == 0 else train).append(data)
      size += len(data)
      if size >= max_bytes:
        break
    self.train = np.frombuffer(b"\n".join(train), np.uint8)
    self.val = np.frombuffer(b"\n".join(val), np.uint8)
    if len(self.train) < 2 or len(self.val) < 2:
      raise ValueError(
        f"data path {str(path or stdlib_path())!r} holds too "
        "little text to train on"
      )
    self.files = len(files)
    self.used_files = len(train) + len(val)
    self.source = (
      f"the standard library of Python {platform.python_version()}"
      if path is None
      else str(path)
    )

  def describe(self) -> dict:
    """What was trained on: where from, how much, and a SHA-256 of the
    train and validation bytes (the stdlib differs between Pythons, so two
    runs' losses compare only when their hashes match)."""
    digest = hashlib.sha256(self.train.tobytes())
    digest.update(b"\0")
    digest.update(self.val.tobytes())
    return {
      "source": self.source,
      "files": self.used_files,
      "bytes": int(len(self.train) + len(self.val)),
      "sha256": digest.hexdigest(),
    }

  def batch(
    self, split: str, step: int, batch_size: int, block_size: int, seed: int = 0
  ) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)``, both ``(batch_size, block_size)`` int32."""
    data = self.train if split == "train" else self.val
    if len(data) <= block_size + 1:
      raise ValueError(
        f"{split} text ({len(data)} bytes) is shorter than "
        f"block_size={block_size}"
      )
    rng = np.random.default_rng([seed, step, split == "val"])
    starts = rng.integers(0, len(data) - block_size - 1, batch_size)
    windows = np.stack([data[s : s + block_size + 1] for s in starts]).astype(
      np.int32
    )
    return windows[:, :-1], windows[:, 1:]

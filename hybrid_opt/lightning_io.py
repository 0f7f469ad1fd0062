"""Lightning checkpoints written straight into their file: `DirectCheckpointIO`.

Lightning's own CheckpointIO buffers the whole checkpoint in RAM before writing it; this one
`torch.save`s into a new file beside the target and renames it over the target once synced, so a
save is whole or not at all and costs no RAM. Local paths only; a URL goes Lightning's own way.

    trainer = lightning.pytorch.Trainer(plugins=[DirectCheckpointIO()], ...)"""

from __future__ import annotations

import os

import torch

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO  # type: ignore[assignment]  # the same class

from hybrid_opt.state.saving import written_whole


class DirectCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose save_checkpoint streams into the file (module docstring)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:  # TorchCheckpointIO's own refusal
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{type(self).__name__}`. Please implement your custom"
                " `CheckpointIO` to define how you'd like to use `storage_options`."
            )
        if "://" in os.fspath(path):
            return super().save_checkpoint(checkpoint, path)
        os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
        with written_whole(path, "save_checkpoint") as part:
            torch.save(checkpoint, part)
        return None

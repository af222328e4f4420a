"""FinalCheckpoint and ModelCheckpoint(save_last=...) leave one last.ckpt at the final step."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from tiny import quiet_trainer

from recipes_lib.checkpoint.weights import checkpoint_step
from recipes_lib.pipeline.runner import FinalCheckpoint


# 10: no step checkpoint before the end, as sft/tiny and dpo/tiny (interval 200 > their
# 150 and 100 steps), where both callbacks wrote "last" and Lightning kept last-v1.ckpt;
# 2: the saver's last.ckpt is a step behind; 3: it is already the final step.
# FinalCheckpoint comes after the saver, as the pipeline adds it (after the configured
# callbacks); link + no version counter is how conf/callbacks configures the saver.
@pytest.mark.parametrize("every", [10, 2, 3])
@pytest.mark.parametrize("save_last", [True, "link"])
def test_one_last_checkpoint_holds_the_final_step(tmp_path, every, save_last):
    folder = tmp_path / "checkpoints"
    saver = ModelCheckpoint(
        dirpath=folder,
        every_n_train_steps=every,
        save_last=save_last,
        enable_version_counter=save_last is True,
    )
    trainer = quiet_trainer(3, [saver, FinalCheckpoint(folder / "last.ckpt")], limit_val_batches=0)
    trainer.fit(BoringModel())
    assert sorted(p.name for p in folder.glob("last*.ckpt")) == ["last.ckpt"]
    assert checkpoint_step(folder / "last.ckpt") == 3

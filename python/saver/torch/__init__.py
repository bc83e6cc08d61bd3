"""PyTorch models and optimizers in three lines.

>>> import saver.torch
>>> saver.torch.save("/ckpt/step-100", model, optimizer, step=100, extra={"epoch": 3})
>>> extra = saver.torch.load("/ckpt/step-100", model, optimizer)   # fills them in place

What goes where (names follow the model, so a checkpoint reads into any split of it):

- every ``nn.Embedding`` / ``nn.EmbeddingBag`` weight (and any 2-D parameter named in
  ``tables=``) is a **row-range table** named by its parameter (``"emb.weight"``): slot
  ``"param"`` holds its values, and each optimizer state of its shape, or of one value per row,
  is a slot of the same table (``"state.sum"`` for Adagrad, ``"state.exp_avg"`` and
  ``"state.exp_avg_sq"`` for Adam), so that it is saved, loaded and resharded with its rows;
- every other parameter and buffer of ``model.state_dict()`` is a **dense tensor** of its name,
  and its optimizer state is ``"optimizer/<parameter>/<state>"`` (a scalar state of a table,
  Adam's ``step``, too);
- the optimizer's param groups (hyperparameters, with parameters by name), its class, ``step``
  and ``extra`` (anything JSON can hold) are in the checkpoint's metadata.

TorchRec: under ``DistributedModelParallel`` a sharded table is a ShardedTensor (or, with
``output_dtensor``, a DTensor holding the rank's shards); each rank gives
its local shards at their global offsets (table-wise, row-wise, column-wise, grid alike) and a
load fills the local shards of whatever plan and world size the model has now, then hands them
to the model's and the fused optimizer's ``load_state_dict``. The fused optimizer's state of the
table's shape is a slot of the table. A row-wise state (row-wise Adagrad's ``momentum1``: one
value per row per column shard) is a ``[rows, column shards]`` slot with the column ranges in the
metadata; loaded into the same column cut it is exact, and a column shard of another cut gets
the mean of the saved shards it overlaps, each weighted by the columns they share (a table-wise
plan: the mean over all of them).

Under ``torch.distributed`` (initialized, world size above 1) every rank calls the same function
with its own replica: rank ``r`` writes rows ``rows·r/W .. rows·(r+1)/W`` of every table and the
ranks share the dense tensors, one save id agreed through the process group and one commit; a
load fills every rank's replica whole. The same with a :class:`saver.Manager` in place of the
path: the step is saved (a delta of the step before when its policy says so) and ``load`` reads
the newest committed step.

The package's parts: ``_items`` (what of a model is a row-range table, what a dense tensor),
``_forms`` (ShardedTensor, DTensor and TorchRec's DTensor form as chunks at global offsets),
``_fused`` (TorchRec's fused optimizer and the row-wise rule), ``_optim`` (a torch
optimizer's state and param groups), ``_metadata`` (the metadata), ``_ranks`` (the ranks'
agreement), ``_saving`` and ``_loading``; every tensor passes saver's host seam
(``saver._host``) on its way to or from the native module.
"""

from ._loading import load, load_latest
from ._metadata import META_KEY, META_VERSION, _meta  # noqa: F401 - _meta: what tests read of a checkpoint
from ._ranks import RanksHandle
from ._saving import save, save_async

__all__ = ["META_KEY", "META_VERSION", "RanksHandle", "load", "load_latest", "save", "save_async"]

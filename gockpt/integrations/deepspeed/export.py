"""``gockpt export PATH --to deepspeed OUT_DIR [--ds-config CONFIG]``: a checkpoint written
through ``gockpt.integrations.deepspeed`` in DeepSpeed's own layout, for an engine without
gockpt: ``OUT_DIR/latest`` names ``global_step<N>/``, which holds what DeepSpeed's
``engine.save_checkpoint`` writes for the same world size and optimizer wrapper --
``mp_rank_00_model_states.pt`` (module weights, counters, LR scheduler, client state, and for
stage 0 the optimizer) and, under ZeRO 1/2, one
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank (the base optimizer's state
and fp32 master partition, loss scaler, paddings, fragment addresses).  A plain
``engine.load_checkpoint(OUT_DIR)`` continues from it exactly as from DeepSpeed's own
checkpoint of that step.

Everything comes from the gockpt checkpoint (read with gockpt's checksummed readers, never
unpickled), the DeepSpeed config included: DeepSpeed stores it (``ds_config``) and it decides
what the files hold -- the ZeRO stage (1 and 2 leave the same state, in other files), the
precision, the gradient clipping, fp32 gradient accumulation, optimizer offload.  The
integration records it at each save as DeepSpeed does (``engine.config``; see
``gockpt.integrations.deepspeed.state.ds_config_record``), without what it cannot store
without pickle (named in the record: a checkpoint whose recorded config lacks something that
decides the layout is refused without ``--ds-config``).

``--ds-config CONFIG`` (JSON) is optional.  Given, it is the config written as ``ds_config``,
and it must agree with the recorded one on what decides the layout (stage, precision,
clipping, fp32 accumulation, offload; anything else may differ) -- else a usage error naming
each difference.  Not given, the recorded config is used.  A checkpoint of an older gockpt
records none: then ``--ds-config`` is needed (the config the run trained with).  Either way
the config is checked against the checkpoint: its precision must be the module weights', and
the optimizer wrapper it builds the one gockpt recorded the loss scaling of
(``loss_scale_config``: stage 0's ``FP16_Optimizer``; ``loss_scaler``: ZeRO's
``DeepSpeedZeroOptimizer``; none: ``BF16_Optimizer``).  Written with DeepSpeed's own classes
(the loss scaler, ``ZeroStageEnum``, ``fragment_address`` are pickled as DeepSpeed pickles
them), so DeepSpeed must be installed.

Two things a gockpt checkpoint does not record.  The ZeRO optimizer's ``overflow`` flag
(whether step N itself overflowed): with a dynamic loss scaler (fp16) it follows from the
scaler's history; otherwise it is written False, which differs from DeepSpeed's only for a
checkpoint of a step bf16 skipped -- and DeepSpeed sets the flag again at the next step before
reading it.  The per-module state-dict versions that ``module.state_dict()`` attaches as
``_metadata``: the module's state dict goes without them, as one read from safetensors does
(it matters only to a module whose ``_load_from_state_dict`` converts an older version's keys).
Refused with the reason: ZeRO 3, fp32 training without an fp16/bf16 wrapper, and the ZeRO
options that change the file layout (``elastic_checkpoint``, ``round_robin_gradients``, NVMe
offload).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ...core.errors import ConfigError
from ...storage.commit import replace_file, write_latest
from ...storage.format import TMP_PREFIX, fsync_dir, fsync_path
from .export_config import (BF16, RECORDED, ZERO, check_dtype, choose, load_config,
                            settings_of, wrapper_kind)
from .export_files import (deepspeed_classes, groups_of, model_states_of, module_dtypes,
                           read_parts, stage0_optimizer, zero_optimizer)


@dataclass
class Export:
    """The DeepSpeed checkpoint, in memory: file name -> object to ``torch.save``."""

    tag: str
    files: Dict[str, dict]
    kind: str
    stage: int
    world: int
    scripts: bool  # DeepSpeed copies zero_to_fp32.py beside a ZeRO checkpoint
    config_from: str = RECORDED  # where ds_config came from
    notes: List[str] = field(default_factory=list)


def build(sources, config_path: Optional[str] = None) -> Export:
    """``sources``: (path, manifest data) of every rank's part, in rank order; ``config_path``:
    ``--ds-config`` (None: the config recorded in the checkpoint)."""
    given = None
    if config_path is not None:  # before anything is read: a wrong config fails at once
        given = settings_of(load_config(config_path), f"--ds-config {config_path}")
    ds = deepspeed_classes()
    parts = read_parts(sources)
    s, notes = choose(given, parts[0].path, parts[0].record)
    check_dtype(s, module_dtypes(parts[0]))
    kind = wrapper_kind(s, parts[0].m.optimizer.cls, parts[0].record["scalers"])
    world = len(parts)
    counters = parts[0].record["counters"]
    tag = f"global_step{counters['global_steps']}"
    optimized = set().union(*(p.record["fp32_layout"] for p in parts))  # every rank's
    model_states = model_states_of(parts[0], optimized, s, kind, world, ds)
    files = {"mp_rank_00_model_states.pt": model_states}
    if kind in (ZERO, BF16):
        groups = groups_of(parts)
        model_states["param_shapes"] = [
            OrderedDict((n, torch.Size(sh)) for n, sh in zip(g.names, g.shapes)) for g in groups]
        prefix = "bf16_" if s.dtype == torch.bfloat16 else ""
        for r, part in enumerate(parts):
            osd = zero_optimizer(part, r, groups, s, kind, world, ds)
            files[f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = {
                "optimizer_state_dict": osd, "ds_config": s.config, "ds_version": ds.version}
    else:
        model_states["optimizer"] = stage0_optimizer(parts[0], s, kind)
    return Export(tag, files, kind, s.stage, world, scripts=kind in (ZERO, BF16),
                  config_from=s.source, notes=notes)


def write(out: str, export: Export, force: bool) -> None:
    """Write ``export`` into ``out``: the tag directory complete under a temporary name, then
    renamed into place (replacing one of the same tag with ``force``), then ``latest``."""
    final = os.path.join(out, export.tag)
    if os.path.lexists(final) and not force:
        raise ConfigError(f"{final}: exists; pass --force to replace it")
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, f"{TMP_PREFIX}{export.tag}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)  # (not mkdtemp: its mode 0700 would stay on the renamed directory)
    try:
        for name, obj in export.files.items():
            f = os.path.join(tmp, name)
            torch.save(obj, f)
            fsync_path(f)
        fsync_dir(tmp)
        if os.path.isdir(final) and not os.path.islink(final):
            shutil.rmtree(final)  # --force
        elif os.path.lexists(final):
            os.unlink(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out)
    if export.scripts:  # as DeepSpeed's _save_zero_checkpoint does: recovery without DeepSpeed
        import deepspeed
        utils = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            src = os.path.join(utils, script)
            if os.path.isfile(src):
                dst = os.path.join(out, script)
                replace_file(dst, lambda t, src=src: shutil.copyfile(src, t))
                os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
    write_latest(out, export.tag)


def describe(export: Export) -> str:
    """One line: what was written."""
    what = f"ZeRO stage {export.stage}" if export.kind in (ZERO, BF16) else "stage 0"
    optim = f" + {export.world} optimizer partition(s)" if export.kind in (ZERO, BF16) else ""
    config = "the config recorded in the checkpoint" if export.config_from == RECORDED \
        else export.config_from
    return (f"DeepSpeed checkpoint {export.tag} ({what}, {export.kind}, {export.world} "
            f"rank(s)): mp_rank_00_model_states.pt{optim}; ds_config: {config}")

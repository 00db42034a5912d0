"""torch_frontend's debug records, profiler ranges and hook handles, as FSDP2's.

FSDP2 logs at debug level ("torch.distributed.fsdp.fully_shard") and labels its
profiler ranges "FSDP::<what> (<module fqn>)" (the root without the suffix). The
frontend does the same under the logger "torch_frontend", silent unless configured,
and keeps the handles of the module hooks it registers where FSDP2 keeps them.
Single process (world size 1): the collectives still run, through JAX.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
from torch import nn

import torch_frontend
from torch_frontend import (
    _checkpoint,
    _clip,
    _fully_shard,
    _group,
    _state,
    _state_dict,
    fully_shard,
)

pytestmark = pytest.mark.torch

LOGGER = "torch_frontend"


class _Net(nn.Module):
    """Two float32 units and a float64 one (its gradients all-reduce in torch's group)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 3)
        self.c = nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).relu()).double())


def _sharded(grouped: bool = False) -> _Net:
    torch_frontend.init_distributed()
    model = _Net()
    if grouped:
        fully_shard([model.a, model.b])
    else:
        fully_shard(model.a)
        fully_shard(model.b)
    fully_shard(model.c)
    return fully_shard(model)


def _step(model: _Net) -> None:
    model(torch.randn(2, 4)).sum().backward()


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_debug_records_name_lazy_init_groups_and_collectives(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    model = _sharded()
    built = _messages(caplog)
    assert [m.split(":")[0] for m in built] == ["fully_shard"] * 4  # one per call
    assert "group of Linear: 2 parameters [weight (3, 4) dim 0, bias (3,) dim 0]" in built[0]
    caplog.clear()
    _step(model)
    _step(model)
    records = _messages(caplog)
    assert sum(m.startswith("FSDP::lazy_init") for m in records) == 1  # the first step only
    assert "root FSDP_Net with 4 fully_shard groups" in records[0]
    for fqn in ("a", "b"):  # forward, then backward (prefetched), per step
        gathers = [m for m in records if m.startswith(f"FSDP::all_gather ({fqn}): all-gather")]
        assert len(gathers) == 4, records
        reduces = [
            m
            for m in records
            if m.startswith(f"FSDP::post_backward_reduce ({fqn}): reduce-scatter")
        ]
        assert len(reduces) == 2, records
    # float64: weight and bias each all-reduced in torch's group, once per step.
    all_reduces = [m for m in records if m.startswith("FSDP::post_backward_reduce (c): all-reduce")]
    assert len(all_reduces) == 4, records
    for hook in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
        assert f"FSDP::{hook} (a)" in records
    assert records.count("FSDP::root_pre_forward") == 2
    assert records.count("FSDP::root_post_backward") == 2


def test_nothing_is_logged_or_built_at_the_default_level(caplog, monkeypatch):
    logger = logging.getLogger(LOGGER)
    assert logger.level == logging.NOTSET and not logger.handlers  # the app decides
    assert not logger.isEnabledFor(logging.DEBUG)

    def built(*_args, **_kwargs):
        raise AssertionError("a debug message was built with debug records off")

    # The expensive messages are guarded by isEnabledFor: their builders never run.
    monkeypatch.setattr(_fully_shard, "_log_group", built)
    monkeypatch.setattr(_state.FSDPState, "_log_lazy_init", built)
    monkeypatch.setattr(_group, "_describe_buckets", built)
    monkeypatch.setattr(_group.FSDPParamGroup, "_log_reduce_scatter", built)
    model = _sharded()
    _step(model)
    assert _messages(caplog) == []


def _trained_with_an_unmanaged_parameter() -> tuple[nn.Module, torch.optim.Optimizer]:
    """float32 only (checkpoints hold no 64-bit parameters); one ignored parameter,
    whose optimizer state a checkpoint holds sharded and `restore` gathers."""
    torch_frontend.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fully_shard(model[0])
    fully_shard(model, ignored_params={model[1].bias})
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_debug_records_of_clipping_state_dicts_and_checkpoints(caplog, tmp_path):
    model, optimizer = _trained_with_an_unmanaged_parameter()
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    torch_frontend.clip_grad_norm_(model.parameters(), 1.0)
    assert _messages(caplog) == [
        # the two managed groups share one layout: one gather of the norm
        "clip_grad_norm_: all-gather over 1 ranks of this rank's norm (order 2.0) of 3 "
        "gradient shard(s), 21 elements: the global norm's reduction"
    ]
    caplog.clear()
    torch_frontend.full_state_dict(model)
    assert _messages(caplog) == [
        "full_state_dict: all-gather of 3 parameters over 1 ranks, 21 elements (torch.float32)"
    ]
    caplog.clear()
    path = tmp_path / "ckpt"
    torch_frontend.save(path, model, optimizer, step=1)
    torch_frontend.restore(path, model, optimizer)
    records = _messages(caplog)
    # 4 parameters, sharded (the ignored bias too: it has dims); each one's Adam exp_avg and
    # exp_avg_sq, sharded, and step, whole; the param group's options and the step, whole.
    leaves = "27 leaves (12 sharded over 1 ranks, 15 whole) through funshard's collectives"
    assert records[:2] == [
        f"save: funshard.save to {path} of {leaves}, in order on the collective thread",
        f"restore: funshard.restore from {path} of {leaves}, in order on the collective thread",
    ]
    # The ignored bias and its optimizer state are restored whole: gathered on every rank.
    assert records[2:] == [
        "restore: all-gather of 1 unmanaged tensors of the model over 1 ranks, 2 elements",
        "restore: all-gather of 2 optimizer-state tensors of unmanaged parameters over 1 "
        "ranks, 4 elements",
    ]


def test_clipping_state_dicts_and_checkpoints_build_nothing_at_the_default_level(
    caplog, monkeypatch, tmp_path
):
    def built(*_args, **_kwargs):
        raise AssertionError("a debug message was built with debug records off")

    monkeypatch.setattr(_clip, "_log_norm_gather", built)
    monkeypatch.setattr(_state_dict, "_log_full_gather", built)
    monkeypatch.setattr(_checkpoint, "_log_checkpoint", built)
    model, optimizer = _trained_with_an_unmanaged_parameter()
    torch_frontend.clip_grad_norm_(model.parameters(), 1.0)
    torch_frontend.full_state_dict(model)
    torch_frontend.save(tmp_path / "ckpt", model, optimizer, step=1)
    torch_frontend.restore(tmp_path / "ckpt", model, optimizer)
    assert _messages(caplog) == []


@pytest.mark.parametrize("grouped", [False, True], ids=["units", "grouped"])
def test_profiler_ranges_carry_the_module_fqn(grouped):
    model = _sharded(grouped)
    _step(model)  # lazy init, and the forward order the prefetches follow
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model)
    names = {e.name for e in prof.events() if e.name.startswith("FSDP::")}
    units = ["a, b"] if grouped else ["a", "b"]
    expected = {
        "FSDP::root_pre_forward",
        "FSDP::root_post_backward_callback",
        # the root: FSDP2 leaves its fqn ("") out
        "FSDP::pre_forward",
        "FSDP::all_gather",
        "FSDP::post_forward",
    }
    for fqn in [*units, "c"]:
        expected |= {
            f"FSDP::{what} ({fqn})"
            for what in (
                "pre_forward",
                "all_gather",
                "all_gather_copy_out",
                "post_forward",
                "pre_backward",
                "post_backward_accumulate",
                "post_backward_reshard",
                "post_backward_reduce",
            )
        }
    expected |= {f"FSDP::backward_prefetch for {fqn}" for fqn in units}
    assert expected <= names, sorted(expected - names)
    assert not any(n.endswith(("(_Net)", "(FSDP_Net)", "()")) for n in names), sorted(names)


def test_hook_handles_remove_the_hooks_as_fsdp2s_do():
    model = _sharded(grouped=True)
    grouped, root = model.a._get_fsdp_state(), model._get_fsdp_state()
    # A group of modules: ONE handle removes every module's pre- and post-hook.
    assert grouped._pre_forward_hook_handle is grouped._post_forward_hook_handle
    assert all(m._forward_pre_hooks and m._forward_hooks for m in (model.a, model.b))
    grouped._pre_forward_hook_handle.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in (model.a, model.b))
    root._pre_forward_hook_handle.remove()
    assert not model._forward_pre_hooks and model._forward_hooks
    root._post_forward_hook_handle.remove()
    assert not model._forward_hooks
    group = model.c._get_fsdp_state()._fsdp_param_group
    hooks = (
        model.c._state_dict_pre_hooks,
        model.c._load_state_dict_pre_hooks,
        model.c._load_state_dict_post_hooks,
    )
    assert all(hooks)
    for handles in (
        group._module_to_pre_save_state_dict_hook_handle,
        group._module_to_pre_load_state_dict_hook_handle,
        group._module_to_post_load_state_dict_hook_handle,
    ):
        assert list(handles) == [model.c]
        handles[model.c].remove()
    assert not any(hooks)

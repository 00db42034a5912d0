"""Error and warning messages: each names the module or parameter and says what to do."""

from __future__ import annotations


def scalar_param(fqn: str) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    return (
        f"fully_shard: parameter {fqn!r} is 0-dimensional, and FSDP shards on dim 0. "
        f"Change {fqn} to a 1D tensor with numel equal to 1 (or keep it out of the "
        "sharded module, e.g. as a buffer)."
    )


def grouped_root(modules) -> str:
    names = ", ".join(type(m).__name__ for m in modules)
    return (
        f"fully_shard: the first forward ran through a group of several modules ({names}), "
        "so that group would be the root; the root must be a single module. Call "
        "fully_shard(model) on the module that contains them and run forward through it."
    )


def child_ran_forward_first(name: str, root: str) -> str:
    return (
        f"fully_shard: module {name!r} already ran forward on its own before the root "
        f"{root} did, so it initialised as a root itself. Run the first forward through "
        "the root module (the outermost fully_shard module)."
    )


def param_in_two_groups(fqn: str, other: str) -> str:
    # FSDP2's wording ("is shared with a parameter already managed by another FSDP
    # group"), which PyTorch's own tests match, plus the name of the other user.
    return (
        f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP "
        f"group (as {other!r}). For shared/tied parameters, use "
        "fully_shard([module_a, module_b]) to place them in the same FSDP group."
    )


def already_managed(fqn: str) -> str:
    return (
        f"fully_shard: parameter {fqn!r} is already managed by another FSDP group (an "
        "outer module was fully sharded first). Apply fully_shard bottom-up: the inner "
        "modules (e.g. each block) first, then their parent."
    )


def replicate_changed(before, now) -> str:
    return (
        f"init_distributed: already initialised with replicate={before!r}; "
        f"replicate={now!r} cannot change it in a running process."
    )


def ranks_disagree(rank: int, world: int, jax_rank: int, jax_world: int) -> str:
    return (
        f"init_distributed: torch's process group has rank {rank} of {world}, but JAX's "
        f"runtime has process {jax_rank} of {jax_world}. Open both from the same "
        "launcher (torchrun), or let init_distributed() open torch's group."
    )


def device_mesh_rank(ndim: int) -> str:
    return (
        f"fully_shard: a DeviceMesh with {ndim} dimensions is not supported; pass a 1-D "
        "mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), as init_device_mesh makes."
    )


def bad_mesh(mesh) -> str:
    return (
        f"fully_shard: mesh must be a torch DeviceMesh (init_device_mesh) or the mesh "
        f"torch_frontend.init_distributed() returns, got {type(mesh).__name__}."
    )


def replaced_param(fqn: str) -> str:
    return (
        f"fully_shard: parameter {fqn!r} was replaced after fully_shard (e.g. "
        "`module.weight = nn.Parameter(...)`); the new tensor is not sharded and would be "
        "ignored. Assign new values in place instead (`with torch.no_grad(): "
        "module.weight.copy_(...)`), or replace it before calling fully_shard."
    )


def meta_forward(fqns: list[str]) -> str:
    return (
        "FSDP parameters should be materialized from meta device before training, but the "
        f"following were still on meta device: {fqns}\nMaterialise the model after "
        "fully_shard with module.to_empty(device=...) and initialise it (e.g. "
        "reset_parameters() on each module) before the first forward."
    )


def reset_on_non_root(fqn: str) -> str:
    return (
        f"reset_iter_state: module {fqn!r} is not the root; call it on the root module "
        "(the one whose forward ran first)."
    )


def view_output(fqn: str) -> str:
    return (
        f"fully_shard: module {fqn!r} returned a view tensor. An in-place op on it (x += y) "
        "would drop the pre-backward hook and skip the re-gather; use out-of-place ops or "
        ".clone() the output first."
    )


def not_supported_yet(what: str, how: str) -> str:
    return f"fully_shard: {what} is not supported by torch_frontend yet; {how}"


def not_fsdp_module(method: str, module) -> str:
    return (
        f"{method}: {type(module).__name__} has no fully_shard state; call "
        "torch_frontend.fully_shard on it first."
    )


def bad_reshard_after_forward(value) -> str:
    return (
        f"fully_shard: reshard_after_forward must be True, False, None or an int group "
        f"size, got {value!r} ({type(value).__name__})."
    )


def hpz_not_divisor(k: int, world: int) -> str:
    return (
        f"fully_shard: reshard_after_forward={k} must divide the shard world size {world} "
        f"(keep 1/k after forward, re-gather within groups of k ranks); pass one of "
        f"{[d for d in range(1, world + 1) if world % d == 0]}, or True / False."
    )


def hpz_one() -> str:
    return (
        "fully_shard: reshard_after_forward=1 (int) means resharding to groups of one "
        "rank, i.e. keeping the whole gathered parameters; it behaves as False."
    )


def bad_placement_fn(fn) -> str:
    return (
        f"fully_shard: shard_placement_fn must be a callable (param -> Shard(dim) or None), "
        f"got {type(fn).__name__}."
    )


def bad_placement(fqn: str, placement) -> str:
    return (
        f"fully_shard: shard_placement_fn returned {placement!r} for parameter {fqn!r}; "
        "return torch.distributed.tensor.Shard(dim) to shard it on dim, or None for dim 0."
    )


def placement_out_of_range(fqn: str, dim: int, shape: tuple) -> str:
    return (
        f"fully_shard: shard_placement_fn returned Shard({dim}) for parameter {fqn!r} of "
        f"shape {shape}; the dim must be in [-{len(shape)}, {len(shape)})."
    )


def missing_key(key: str) -> str:
    return f"  missing key {key!r}"


def unexpected_key(key: str) -> str:
    return f"  unexpected key {key!r}"


def key_shape(key: str, got, want) -> str:
    return f"  key {key!r} has shape {tuple(got)}; the module's full tensor has shape {tuple(want)}"


def key_not_tensor(key: str, value) -> str:
    return f"  key {key!r} holds a {type(value).__name__}, not a tensor"


def full_state_dict_mismatch(problems) -> str:
    return (
        "load_full_state_dict: the state dict does not fit the module:\n" + "\n".join(problems)
        + "\nPass the full (unsharded) tensors of every key of the module's state_dict(), "
        "as full_state_dict() or an unsharded copy's state_dict() returns them."
    )


def optimizer_param_not_in_module(group: int, index: int, shape) -> str:
    return (
        f"save/restore: parameter {index} of the optimizer's param group {group} (shape "
        f"{tuple(shape)}) is not a parameter of the module. Build the optimizer from "
        "module.parameters() after fully_shard, and pass that module."
    )


def optimizer_state_unsupported(fqn: str, name: str, value) -> str:
    shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
    return (
        f"save: optimizer state {name!r} of parameter {fqn!r} is a {type(value).__name__}"
        f"{shape}; only tensors shaped like the parameter's local shard, 0-d tensors and "
        "Python numbers are supported yet."
    )


def checkpoint_has_optimizer(path: str) -> str:
    return (
        f"restore: the checkpoint at {path} holds optimizer state; pass the optimizer "
        "(restore(path, module, optimizer)) to restore it too."
    )


def checkpoint_lacks_optimizer(path: str) -> str:
    return (
        f"restore: the checkpoint at {path} holds no optimizer state; pass optimizer=None, "
        "or restore from a checkpoint saved with the optimizer."
    )


def checkpoint_optimizer_mismatch(path: str, problems) -> str:
    return (
        f"restore: the optimizer state in the checkpoint at {path} does not fit the "
        "optimizer:\n" + "\n".join(problems)
        + "\nRestore into an optimizer of the same kind, built over the same parameters."
    )


def checkpoint_module_mismatch(detail: str) -> str:
    return (
        f"{detail}\nThe module (and optimizer) must have the keys, shapes and dtypes of "
        "the saved ones; the checkpoint's paths are ['model'][<state_dict key>], "
        "['optimizer']['state'][<parameter name>][<state name>], "
        "['optimizer']['param_groups'][<i>][<option>] and ['step']."
    )


def bad_norm_type(norm_type) -> str:
    return (
        f"clip_grad_norm_: norm_type={norm_type!r} is not supported; pass a positive "
        "number (2.0 is the default) or float('inf')."
    )


def nonfinite_norm(norm_type) -> str:
    return (
        f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
        "non-finite, so it cannot be clipped. To scale the gradients by the non-finite "
        "norm anyway, set error_if_nonfinite=False."
    )


def checkpoint_64bit(key: str, dtype) -> str:
    return (
        f"torch_frontend.save: parameter {key!r} has the 64-bit dtype {dtype}, which "
        "funshard's JAX format (x64 off) cannot hold exactly. Save this model with "
        "torch.distributed.checkpoint (dcp.save(get_model_state_dict(model))) instead."
    )

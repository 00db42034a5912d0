"""Flax linen adapter (placeholder until the linen unit lands)."""

from funshard.flax import _errors


def fully_shard_class(module, options):
    raise TypeError(_errors.not_a_module(module))

"""Pinned MoE routing for comparisons of two models built alike, through Megatron's routing replay
(`moe_enable_routing_replay=True` on the config): the first model records each router's top-k
choice, the second replays it, so two expert implementations are compared on the same routes. A
near-tied choice (two experts' probabilities within the arms' rounding) otherwise flips between
them, and the last MoE layer's adapter gradients differ by far more than rounding
(benchmarks/results/h200/2026-12-07/README.md)."""

import contextlib

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


def _replays(model) -> list:
    found = [m.router_replay for m in model.modules()
             if getattr(m, "router_replay", None) is not None]
    assert found, "no router records: build the model with moe_enable_routing_replay=True"
    return found


@contextlib.contextmanager
def recorded_routes(model):
    """Runs the block with every router of `model` recording; yields a list that holds each
    router's last top-k indices [tokens, topk] after the block."""
    replays, routes = _replays(model), []
    for replay in replays:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield routes
        routes.extend(replay.get_recorded_indices() for replay in replays)
    finally:
        for replay in replays:
            replay.clear_router_replay_action()


@contextlib.contextmanager
def replayed_routes(model, routes):
    """Runs the block with every router of `model` taking `routes` (recorded_routes' list, routers
    in the same order), in the forward and in a recompute's forward alike."""
    replays = _replays(model)
    assert len(replays) == len(routes), (len(replays), len(routes))
    for replay, route in zip(replays, routes):
        replay.target_topk_idx = route
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()


def forget_routers() -> None:
    """Drops Megatron's process-wide list of router records (each model built with the flag
    appends its routers' there)."""
    RouterReplay.clear_global_router_replay_instances()

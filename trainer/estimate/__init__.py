"""The estimator behind `eightfold estimate`: the seed's formulas for parameters, bytes of model state,
activations, FLOPs, collective bytes, step time, pipeline bubble and KV cache, computed for any config
and layout without allocating anything (`formulas`, `run`), the link each parallel dimension's groups use
and its seconds per step, with the seed's placement rules (`links`), serving on a GPU: KV capacity, TTFT,
and the decode roofline by concurrency (`serving`), pipeline schedules played on an ideal clock
(`schedule`), named presets (`presets`), pictures (`plots`), the command (`cli`), and the FLOP count of a
real model's forward and backward that the trainer logs next to the estimate (`flop_count`)."""

from .run import JSON_KEYS, estimate_run, tracking_params

__all__ = ["JSON_KEYS", "count_model_flops", "estimate_run", "tracking_params"]


def __getattr__(name: str):
    # torch is imported only by whoever counts FLOPs: `eightfold estimate` itself never needs it.
    if name == "count_model_flops":
        from .flop_count import count_model_flops

        return count_model_flops
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

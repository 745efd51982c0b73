"""Serving metrics in the Prometheus text format under vLLM's names and labels
(vllm/v1/metrics/loggers.py): every series carries `model_name` (the served name, so a router's
replicas and canary are told apart) and `engine` (the engine's index under that name), so vLLM's
Grafana dashboards, the alerts and the HPA that the serve stage renders (k8s.py) read this server
unchanged. Counters are named without `_total` and rendered with it, as prometheus_client does.

What they measure is the seed's "operating it": TTFT, time per output token, end-to-end latency,
queue time (the SLOs); running / waiting requests and KV-cache usage (autoscaling); prefix-cache
hits, preemptions, speculative acceptance. Two series are ours alone (no vLLM equivalent):
`eightfold:requests_rejected` (429s) and the prefill -> decode K/V transfer (disagg.py)."""

from __future__ import annotations

import bisect
import threading
from typing import Callable

# vLLM's buckets for each histogram (loggers.py), so quantiles interpolate alike
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _matches(key: tuple, labels: dict[str, str]) -> bool:
    have = dict(key)
    return all(have.get(k) == str(v) for k, v in labels.items())


def _key(labels: dict[str, str]) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self._series: dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]
        self._lock = threading.Lock()

    def observe(self, value: float, **labels: str) -> None:
        self.observe_many([value], **labels)

    def observe_many(self, values: list[float], **labels: str) -> None:
        """Several observations of one label set at once (an engine step's worth)."""
        key = _key(labels)
        buckets, nb = self.buckets, len(self.buckets)
        with self._lock:
            s = self._series.setdefault(key, [0] * nb + [0.0, 0])
            for value in values:
                i = bisect.bisect_left(buckets, value)
                if i < nb:
                    s[i] += 1
                s[-2] += value
            s[-1] += len(values)

    def count(self, **labels: str) -> int:
        """Observations over every series whose labels include `labels`."""
        return sum(s[-1] for k, s in list(self._series.items()) if _matches(k, labels))

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            for key, s in sorted(self._series.items()):
                labels = dict(key)
                cum = 0
                for b, c in zip(self.buckets, s):
                    cum += c
                    out.append(f"{self.name}_bucket{_labels({**labels, 'le': repr(float(b))})} {cum}")
                out.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {s[-1]}")
                out.append(f"{self.name}_sum{_labels(labels)} {s[-2]}")
                out.append(f"{self.name}_count{_labels(labels)} {s[-1]}")
        return out


class Counter:
    """Rendered as `<name>_total`, the sample name prometheus_client gives a counter `<name>`."""

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = _key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """The sum over every series whose labels include `labels`."""
        return sum(v for k, v in list(self._values.items()) if _matches(k, labels))

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, v in sorted(self._values.items()):
            out.append(f"{self.name}_total{_labels(dict(key))} {v}")
        return out


class Gauge:
    """Read at scrape time from a callback per label set."""

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self._fns: dict[tuple, Callable[[], float]] = {}

    def set_function(self, fn: Callable[[], float], **labels: str) -> None:
        self._fns[_key(labels)] = fn

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        for key, fn in sorted(self._fns.items()):
            out.append(f"{self.name}{_labels(dict(key))} {float(fn())}")
        return out


class ServeMetrics:
    """The engines' metrics; one instance is shared by every engine behind one server."""

    def __init__(self) -> None:
        v = "vllm"
        self.ttft = Histogram(f"{v}:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = Histogram(f"{v}:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TPOT_BUCKETS)
        # the same observations under the name vLLM used for them before 0.11 (dashboards of that age read it)
        self.itl_legacy = Histogram(f"{v}:time_per_output_token_seconds",
                                    "Histogram of time per output token in seconds (deprecated name of "
                                    "vllm:inter_token_latency_seconds).", TPOT_BUCKETS)
        self.tpot = Histogram(f"{v}:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = Histogram(f"{v}:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(f"{v}:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Counter(f"{v}:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = Counter(f"{v}:generation_tokens", "Number of generation tokens processed.")
        self.requests = Counter(f"{v}:request_success", "Count of successfully processed requests.")
        self.prefix_queries = Counter(f"{v}:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = Counter(f"{v}:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.spec_drafts = Counter(f"{v}:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_proposed = Counter(f"{v}:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = Counter(f"{v}:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        # vLLM's per-position series (label `position`, 0 = the first draft token): with MTP, depth position + 1
        self.spec_accepted_per_pos = Counter(f"{v}:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft token position.")
        self.preemptions = Counter(f"{v}:num_preemptions", "Cumulative number of preemption from the engine.")
        self.running = Gauge(f"{v}:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = Gauge(f"{v}:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = Gauge(f"{v}:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.rejected = Counter("eightfold:requests_rejected", "Requests refused with 429 (overload)")
        # prefill/decode disaggregation (disagg.py): the K/V shipped from prefill to decode engines
        self.kv_transfer_bytes = Counter("eightfold:kv_transfer_bytes", "Bytes of K/V payloads shipped prefill -> decode")
        self.kv_transfer_time = Histogram("eightfold:kv_transfer_seconds",
                                          "Time to export, serialise, deserialise and import one request's K/V")
        self._engines: dict[str, int] = {}
        self._lock = threading.Lock()

    def engine_labels(self, model_name: str) -> dict[str, str]:
        """Labels for a new engine serving `model_name`: the next `engine` index under that name."""
        with self._lock:
            index = self._engines.get(model_name, 0)
            self._engines[model_name] = index + 1
        labels = {"model_name": model_name, "engine": str(index)}
        # every series exists from the start at zero, as prometheus_client's labelled children do:
        # a rate() or an alert over a counter that has not moved yet still finds it
        for m in vars(self).values():
            if m is self.requests:
                for reason in ("stop", "length", "abort"):
                    m.inc(0, **labels, finished_reason=reason)
            elif isinstance(m, Counter):
                m.inc(0, **labels)
            elif isinstance(m, Histogram):
                m.observe_many([], **labels)
        return labels

    def render(self) -> str:
        lines: list[str] = []
        for m in vars(self).values():
            if isinstance(m, (Histogram, Counter, Gauge)):
                lines.extend(m.render())
        return "\n".join(lines) + "\n"

    def names(self) -> set[str]:
        """The metric names as a Prometheus query writes them (counters with `_total`)."""
        return {m.name + "_total" if isinstance(m, Counter) else m.name
                for m in vars(self).values() if isinstance(m, (Histogram, Counter, Gauge))}

"""Serving metrics in the Prometheus text format: counters, gauges and histograms with a `model`
label, so a router's replicas and canary are told apart (the SLOs of the seed's "operating it":
TTFT, inter-token latency, end-to-end latency, queue time; KV usage and queue depth for autoscaling)."""

from __future__ import annotations

import bisect
import threading
from typing import Callable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self._series: dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]
        self._lock = threading.Lock()

    def observe(self, value: float, **labels: str) -> None:
        self.observe_many([value], **labels)

    def observe_many(self, values: list[float], **labels: str) -> None:
        """Several observations of one label set at once (an engine step's worth)."""
        key = tuple(sorted(labels.items()))
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
        s = self._series.get(tuple(sorted(labels.items())))
        return s[-1] if s else 0

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
    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, v in sorted(self._values.items()):
            out.append(f"{self.name}{_labels(dict(key))} {v}")
        return out


class Gauge:
    """Read at scrape time from a callback per label set."""

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self._fns: dict[tuple, Callable[[], float]] = {}

    def set_function(self, fn: Callable[[], float], **labels: str) -> None:
        self._fns[tuple(sorted(labels.items()))] = fn

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        for key, fn in sorted(self._fns.items()):
            out.append(f"{self.name}{_labels(dict(key))} {float(fn())}")
        return out


class ServeMetrics:
    """The engine's metrics; one instance is shared by every engine behind one server."""

    def __init__(self) -> None:
        p = "eightfold"
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time from arrival to the first output token")
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue = Histogram(f"{p}_request_queue_time_seconds", "Time from arrival to first scheduling")
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "Prompt tokens admitted")
        self.generation_tokens = Counter(f"{p}_generation_tokens_total", "Output tokens generated")
        self.requests = Counter(f"{p}_requests_total", "Finished requests by finish reason")
        self.rejected = Counter(f"{p}_requests_rejected_total", "Requests refused with 429 (overload)")
        self.prefix_queries = Counter(f"{p}_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = Counter(f"{p}_prefix_cache_hits_total", "Prompt tokens found in the prefix cache")
        self.spec_proposed = Counter(f"{p}_spec_decode_num_draft_tokens_total", "Draft tokens verified")
        self.spec_accepted = Counter(f"{p}_spec_decode_num_accepted_tokens_total", "Draft tokens accepted")
        self.preemptions = Counter(f"{p}_num_preemptions_total", "Requests preempted (recompute)")
        self.running = Gauge(f"{p}_num_requests_running", "Requests in the running batch")
        self.waiting = Gauge(f"{p}_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = Gauge(f"{p}_kv_cache_usage_perc", "Fraction of KV blocks in use")
        # prefill/decode disaggregation (disagg.py): the K/V shipped from prefill to decode engines
        self.kv_transfer_bytes = Counter(f"{p}_kv_transfer_bytes_total", "Bytes of K/V payloads shipped prefill -> decode")
        self.kv_transfer_time = Histogram(f"{p}_kv_transfer_seconds",
                                          "Time to export, serialise, deserialise and import one request's K/V")

    def render(self) -> str:
        lines: list[str] = []
        for m in vars(self).values():
            lines.extend(m.render())
        return "\n".join(lines) + "\n"

"""A server's live state for the engine panel, when the engine is a server's (engine.remote.RemoteEngine).

:class:`RemotePoller` asks the server for ``GET /slots`` (llama.cpp's shape, which a Cadence server and
llama.cpp's own serve) and ``GET /metrics`` (Prometheus text: ``cadence:``, ``vllm:`` or ``llamacpp:``
names) twice a second while the panel is shown, on a thread of its own, so the window never waits on the
network, and hands the panel a snapshot shaped like ``Engine.status()`` (one lane per model the server
names), through the bridge's ``status_changed`` signal. What a server does not report is said in one sentence, never guessed.
"""

from __future__ import annotations

import threading
import time

from engine.errors import CadenceError

POLL_INTERVAL_S = 0.5
KINDS = {"cadence": "a Cadence server", "vllm": "vLLM", "llamacpp": "llama.cpp's server"}
# what the panel reads -> the sample's name after the server's prefix, by server kind (vLLM's newer and
# older names both; llama.cpp's own names)
NAMES = {
    "running": {"cadence": ["num_requests_running"], "vllm": ["num_requests_running"],
                "llamacpp": ["requests_processing"]},
    "waiting": {"cadence": ["num_requests_waiting"], "vllm": ["num_requests_waiting"],
                "llamacpp": ["requests_deferred"]},
    "generated": {"cadence": ["generation_tokens_total"], "vllm": ["generation_tokens_total"],
                  "llamacpp": ["tokens_predicted_total"]},
    "prompt": {"cadence": ["prompt_tokens_total"], "vllm": ["prompt_tokens_total"],
               "llamacpp": ["prompt_tokens_total"]},
    "first_token": {"cadence": ["time_to_first_token_seconds"], "vllm": ["time_to_first_token_seconds"]},
    "per_token": {"cadence": ["time_per_output_token_seconds"],
                  "vllm": ["inter_token_latency_seconds", "time_per_output_token_seconds"]},
    "end_to_end": {"cadence": ["e2e_request_latency_seconds"], "vllm": ["e2e_request_latency_seconds"]},
    "drafted": {"cadence": ["spec_decode_num_draft_tokens_total"], "vllm": ["spec_decode_num_draft_tokens_total"]},
    "accepted": {"cadence": ["spec_decode_num_accepted_tokens_total"],
                 "vllm": ["spec_decode_num_accepted_tokens_total"]},
    "width": {"cadence": ["lane_width"]},
    "cache": {"vllm": ["kv_cache_usage_perc", "gpu_cache_usage_perc"], "llamacpp": ["kv_cache_usage_ratio"]},
}
HISTOGRAMS = ("first_token", "per_token", "end_to_end")
NEVER_REPORTED = ["step time", "calibration", "precision"]  # a server keeps these to itself


def server_kind(metrics: dict | None) -> str | None:
    """'cadence', 'vllm' or 'llamacpp' by the prefix of the metrics' names; None when none is known."""
    for kind in KINDS:
        if any(name.startswith(kind + ":") for name in metrics or {}):
            return kind
    return None


def read_metrics(metrics: dict | None) -> dict[str, dict[str | None, float]]:
    """What the panel reads, per model (the ``model_name`` label; None where the server names none): running,
    waiting, generated, prompt, width, cache, drafted, accepted, and the mean of each latency histogram."""
    kind = server_kind(metrics)
    out: dict[str, dict[str | None, float]] = {}
    if kind is None:
        return out

    def summed(sample: str) -> dict[str | None, float]:
        by_model: dict[str | None, float] = {}
        for labels, value in metrics.get(sample, []):
            model = labels.get("model_name")
            by_model[model] = by_model.get(model, 0.0) + value
        return by_model

    for key, kinds in NAMES.items():
        for name in kinds.get(kind, []):
            full = f"{kind}:{name}"
            if key in HISTOGRAMS:
                sums, counts = summed(full + "_sum"), summed(full + "_count")
                if counts:
                    out[key] = {m: sums.get(m, 0.0) / n for m, n in counts.items() if n}
                    break
            elif full in metrics:
                out[key] = summed(full)
                break
    return out


def _total(values: dict | None) -> float | None:
    return None if not values else sum(values.values())


def _mean(values: dict | None) -> float | None:
    return None if not values else sum(values.values()) / len(values)


def describe(url: str, slots: list | None, metrics: dict | None, read: dict) -> tuple[str, str]:
    """(what the server reports, in one line; what it does not, in one sentence)."""
    kind = server_kind(metrics)
    parts = [f"Server: {url}" + (f" ({KINDS[kind]})" if kind else "")]
    if read.get("running") is not None or read.get("waiting") is not None:
        running = _total(read.get("running")) or 0
        parts.append(f"{running:.0f} request{'' if running == 1 else 's'} running, "
                     f"{_total(read.get('waiting')) or 0:.0f} waiting")
    if read.get("generated") is not None or NAMES["generated"].get(kind):  # (a labelled counter: none until counted)
        parts.append(f"{_total(read.get('generated')) or 0:.0f} tokens generated, "
                     f"{_total(read.get('prompt')) or 0:.0f} prompt tokens")
    times = [f"{label} {value:.2f} s" for label, key in (("first token", "first_token"), ("per token", "per_token"),
                                                         ("end to end", "end_to_end"))
             if (value := _mean(read.get(key))) is not None]
    if times:
        parts.append("means: " + ", ".join(times))
    drafted, accepted = _total(read.get("drafted")), _total(read.get("accepted"))
    if drafted:
        parts.append(f"drafts: {accepted / drafted:.0%} of {drafted:.0f} accepted")
    if read.get("cache") is not None:
        parts.append(f"KV cache {_mean(read['cache']):.0%} used")
    missing = list(NEVER_REPORTED)
    if slots is None:
        missing.append("its slots (it has no /slots)")
    if metrics is None:
        missing.append("its metrics (it has no /metrics)")
    elif kind is None and metrics:  # (empty: nothing counted yet, as while a server loads)
        missing.append("metrics Cadence can read (its /metrics has no cadence:, vllm: or llamacpp: names)")
    elif kind is not None:  # what this kind of server never exports (a labelled series appears once counted)
        missing += [what for key, what in (("running", "requests running and waiting"),
                                           ("generated", "token counts"), ("first_token", "latencies"),
                                           ("drafted", "drafting")) if not NAMES[key].get(kind)]
    sentence = "This server does not report " + ", ".join(missing[:-1]) + " or " + missing[-1] + "."
    return " · ".join(parts), sentence


def remote_status(url: str, slots: list | None, metrics: dict | None, now: float | None = None) -> dict:
    """A snapshot shaped like ``Engine.status()`` from a server's /slots and /metrics: one lane per model
    (``remote`` set, so the panel says what it cannot show), its slots in llama.cpp's order."""
    read = read_metrics(metrics)
    lanes: dict[str, dict] = {}

    def lane(model: str) -> dict:
        return lanes.setdefault(model, {"remote": True, "slots": [], "width_from": "the server", "calibration": None,
                                        "waiting": 0, "drafting": {}, "counters": {}})

    for slot in slots or []:
        model = str(slot.get("model") or "the server's model")
        index = int(slot.get("slot", slot.get("id", 0)) or 0)
        entries = lane(model)["slots"]
        entries.extend([None] * (index + 1 - len(entries)))
        if slot.get("is_processing"):
            drafting = slot.get("drafting") or {}
            entries[index] = {"request": f"server request {slot.get('id_task')}", "context": slot.get("n_ctx"),
                              "tokens": int((slot.get("next_token") or {}).get("n_decoded") or 0),
                              "drafted": drafting.get("drafted"), "accepted": drafting.get("accepted")}
    for key in ("running", "waiting", "generated", "width", "drafted", "accepted"):
        for model, value in (read.get(key) or {}).items():
            if model is None and not lanes:
                model = "the server's model"
            elif model is None:
                model = next(iter(lanes))
            entry = lane(model)
            if key == "generated":
                entry["counters"]["generated"] = value
            elif key in ("drafted", "accepted"):
                entry["drafting"][key] = value
            else:
                entry[key] = value
    for entry in lanes.values():
        entry["width"] = int(entry.get("width") or len(entry["slots"]))
        if entry["drafting"]:
            entry["drafting"].update(drafter="the server's", state="reported")
    summary, missing = describe(url, slots, metrics, read)
    return {"backend": url, "backend_name": f"a server at {url}", "batch": None, "batch_from": "the server",
            "lanes": lanes, "labels": {}, "sampled_at": now if now is not None else time.monotonic(),
            "remote": {"url": url, "summary": summary, "missing": missing, "slots": slots is not None,
                       "metrics": metrics is not None, "kind": server_kind(metrics), "error": None}}


class RemotePoller:
    """Asks the bridge's engine, while it is a server's, for its slots and metrics every ``interval`` seconds
    on a thread of its own, and sends each snapshot through ``bridge.status_changed`` (Qt queues it to the
    window's thread). A server that cannot be asked gives a snapshot whose ``remote.error`` says why."""

    def __init__(self, bridge, interval: float = POLL_INTERVAL_S):
        self.bridge = bridge
        self.interval = interval
        self.polls = 0
        self.active = True  # set by the window: polled only while the engine panel is shown (each ask costs the
        # server a status read beside its decoding)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-app-remote-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            engine = self.bridge.engine
            if not self.active or not self.bridge.remote:
                continue
            try:
                status = self.sample(engine)
            except Exception as exc:  # never let the poller die: the panel says what happened
                status = self._failed(engine, f"Reading the server's state failed ({exc.__class__.__name__}).")
            if not self._stop.is_set() and engine is self.bridge.engine:
                self.polls += 1
                self.bridge.status_changed.emit(status)

    def sample(self, engine) -> dict:
        try:
            slots = engine.slots()
            metrics = engine.metrics()
        except CadenceError as exc:
            return self._failed(engine, str(exc))
        return remote_status(engine.url, slots, metrics)

    @staticmethod
    def _failed(engine, sentence: str) -> dict:
        status = remote_status(engine.url, None, None)
        status["remote"]["error"] = sentence
        return status

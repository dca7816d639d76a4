"""bench_server.py's measuring: one prompt or a queue of them through a real ComfyUI server, timed on its websocket
(dev/comfy_ws.py), and where a prompt's time went.

Clocks: `time.perf_counter()` of this process. A prompt's latency runs from just before its POST /prompt to the
arrival of the `executing` message with node None that ComfyUI sends once the prompt's history is written (both
ComfyUIs). Per node: from its `executing` message (sent when its inputs are gathered, just before it runs) to the
next node's `executing`, or for the last node to `execution_success` (current ComfyUI) or the closing `executing`
(2024's, which has no success message). Nodes served from ComfyUI's cache send no `executing` and take no time.
`executor`: `execution_start` to the end of the last node; `overhead` is latency minus executor (the POST and
its validation, the queue hand-off, writing the history). All messages reach us through the server's one
ordered send loop, so their gaps are the server's, plus the loop's own delay (it encodes preview images there).
"""
import statistics
import time

# the phases of issue #21 item 4, by node class
PHASES = {"KSampler": "sampling", "SDAccelKSampler": "sampling", "VAEDecode": "vae_decode",
          "SDAccelVAEDecode": "vae_decode", "VAEEncode": "vae_encode", "CLIPTextEncode": "text_encode",
          "SaveImage": "save", "SDAccelSaveImage": "save", "ControlNetLoader": "controlnet", "ControlNetApplyAdvanced": "controlnet",
          "CheckpointLoaderSimple": "load", "LoadImage": "load"}
COLUMNS = ("sampling", "vae_decode", "vae_encode", "text_encode", "controlnet", "save", "load", "other",
           "executor", "overhead")


class PromptFailed(RuntimeError):
    pass


def _check(msgs, pid):
    for m in msgs:
        if not m.binary and m.type in ("execution_error", "execution_interrupted"):
            d = m.data
            raise PromptFailed("prompt %s: %s in node %s (%s): %s" % (pid, m.type, d.get("node_id"), d.get("node_type"),
                                                                        d.get("exception_message")))


def run_prompt(srv, ev, wf, timeout=600):
    """One prompt, queued alone: its latency, messages, phases and what its nodes reported."""
    start = ev.mark()
    t0 = time.perf_counter()
    pid = srv.queue(wf)
    done = ev.wait_done(pid, start, timeout)
    latency = ev.messages[done].t - t0
    msgs = ev.of_prompt(pid, start)
    _check(msgs, pid)
    return {"pid": pid, "latency": latency, "phases": phases(msgs, wf, latency), "msgs": msgs,
            "previews": sum(m.binary for m in msgs), "outputs": executed_outputs(msgs)}


def run_queue(srv, ev, wfs, timeout=600):
    """`wfs` queued at once: seconds from the first POST to the end of the last prompt (ComfyUI runs them in order)."""
    start = ev.mark()
    t0 = time.perf_counter()
    pids = [srv.queue(wf) for wf in wfs]
    done = ev.wait_done(pids[-1], start, timeout * len(wfs))
    elapsed = ev.messages[done].t - t0
    for pid in pids:
        _check(ev.of_prompt(pid, start), pid)
    return elapsed


def phases(msgs, wf, latency):
    """Seconds per phase of one prompt (see the module's docstring)."""
    out = dict.fromkeys(COLUMNS, 0.0)
    t_start = next(m.t for m in msgs if m.type == "execution_start")
    current, t_node, t_end = None, None, None
    for m in msgs:
        if m.binary:
            continue
        ends = m.type == "executing" or m.type == "execution_success"
        if ends and current is not None:
            out[PHASES.get(wf[current]["class_type"], "other")] += m.t - t_node
            current, t_end = None, m.t
        if m.type == "executing" and m.data.get("node") is not None:
            current, t_node = m.data["node"], m.t
    out["executor"] = (t_end or t_start) - t_start
    out["overhead"] = latency - out["executor"]
    return out


def executed_outputs(msgs):
    """{node id: its UI output} from the prompt's `executed` messages (our nodes' reports, SaveImage's files)."""
    return {m.data["node"]: m.data.get("output") for m in msgs if not m.binary and m.type == "executed"}


def median_phases(runs, per):
    """Median of each phase over `runs`, divided by `per` (the batch: seconds per image)."""
    return {k: round(statistics.median(r["phases"][k] for r in runs) / per, 4) for k in COLUMNS}

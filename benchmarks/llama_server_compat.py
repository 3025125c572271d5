"""Side by side: llama-server's native routes on justllm against llama-server itself.

    llama-server -m MODEL -np 4 -t 2 -c 8192 --port 8081
    justllm serve MODEL --port 8080
    python benchmarks/llama_server_compat.py http://127.0.0.1:8081 http://127.0.0.1:8080

Sends the same greedy ``/completion`` requests (prompt forms, stop words, several prompts,
``n_probs``, a stream) and ``/tokenize``/``/detokenize``/``/props`` to both and prints what
differs: the answers' texts, token ids, processed prompts, stop types, counts and logprobs
(within ``--tolerance`` nats: a prompt computed in another batch shape moves them slightly),
and the answer fields one server has and the other has not. Exit status 1 when an answer
differs; missing fields are listed, not counted (justllm leaves out what it has no value for).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

REQUESTS: list[dict[str, Any]] = [
    {"prompt": "The capital of France is", "n_predict": 12, "return_tokens": True},
    {"prompt": "1, 2, 3,", "n_predict": 20, "stop": [" 6"]},
    {"prompt": ["Hello", [2, 9259], [2, "Hello"]], "n_predict": 4},
    {"prompt": "Once upon a time, in a land far away,", "n_predict": 3, "n_probs": 3},
    {"prompt": "The sky is", "n_predict": 6, "samplers": "kt", "top_k": 1, "temperature": 1.5},
    {"prompt": "Write a list:\n", "n_predict": 8, "logit_bias": [["-", False]]},
]
COMPARED = ("content", "tokens", "prompt", "stop_type", "stopping_word", "tokens_predicted",
            "tokens_evaluated", "truncated", "has_new_line", "stop")


def post(url: str, path: str, body: dict) -> Any:
    r = httpx.post(url + path, json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/completion", json={**body, "stream": True},
                      timeout=120) as r:
        r.raise_for_status()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def logprobs_differ(a: list[dict], b: list[dict], tolerance: float) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x["id"] != y["id"]:
            return f"token {i}: id {x['id']} vs {y['id']}"
        if abs(x["logprob"] - y["logprob"]) > tolerance:
            return f"token {i}: logprob {x['logprob']:.4f} vs {y['logprob']:.4f}"
        if [t["id"] for t in x["top_logprobs"]] != [t["id"] for t in y["top_logprobs"]]:
            return f"token {i}: top ids differ"
    return None if len(a) == len(b) else f"{len(a)} vs {len(b)} entries"


def compare(ref: dict, got: dict, tolerance: float) -> tuple[list[str], set[str], set[str]]:
    diffs = [f"{key}: {ref.get(key)!r} vs {got.get(key)!r}" for key in COMPARED
             if key in ref and ref.get(key) != got.get(key)]
    if "completion_probabilities" in ref:
        why = logprobs_differ(ref["completion_probabilities"],
                              got.get("completion_probabilities", []), tolerance)
        if why:
            diffs.append(f"completion_probabilities: {why}")
    return diffs, set(ref) - set(got), set(got) - set(ref)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", help="llama-server's URL")
    ap.add_argument("candidate", help="justllm's URL")
    ap.add_argument("--tolerance", type=float, default=0.05, help="logprob difference allowed")
    args = ap.parse_args()
    failed = 0
    missing: set[str] = set()
    extra: set[str] = set()
    for body in REQUESTS:
        body = {"temperature": 0, **body}
        ref, got = (post(u, "/completion", body) for u in (args.reference, args.candidate))
        pairs = zip(ref, got) if isinstance(ref, list) else [(ref, got)]
        for r, g in pairs:
            diffs, m, e = compare(r, g, args.tolerance)
            missing |= m
            extra |= e
            print(("DIFF " if diffs else "same ") + json.dumps(body)[:90])
            for d in diffs:
                print("     " + d)
            failed += bool(diffs)
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0}
    ref_events, got_events = (stream(u, body) for u in (args.reference, args.candidate))
    same = ["".join(e["content"] for e in ref_events) == "".join(e["content"] for e in got_events),
            ref_events[-1]["stop"] and got_events[-1]["stop"]]
    print(("same " if all(same) else "DIFF ") + "stream: text and the final stop event")
    failed += not all(same)
    tok = {"content": "Hello <start_of_turn> world", "add_special": True, "with_pieces": True}
    r, g = (post(u, "/tokenize", tok) for u in (args.reference, args.candidate))
    print(("same " if r["tokens"] == g["tokens"] else "DIFF ") + "/tokenize with_pieces")
    failed += r["tokens"] != g["tokens"]
    props = [httpx.get(u + "/props", timeout=30).json() for u in (args.reference, args.candidate)]
    print("/props n_ctx per request: " + " vs ".join(
        str(p["default_generation_settings"]["n_ctx"]) for p in props))
    print("fields only llama-server gives: " + (", ".join(sorted(missing)) or "none"))
    print("fields only justllm gives: " + (", ".join(sorted(extra)) or "none"))
    print(f"{failed} difference(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine B of the end-to-end test, run as its own process: a fresh SmolLM2 instance loads the
cached prefix of each prompt from kvpool, prefills the rest and decodes greedily.

    python -m tests._hf_engine NODE_URL MODEL_ID IN.pt OUT.pt

IN.pt holds {"prompts": [[token ids]], "steps": int}; OUT.pt gets, per prompt,
{"loaded": tokens loaded, "tokens": [...], "logits": [steps, vocab]}.
"""

from __future__ import annotations

import sys

import torch


def main(argv: list[str]) -> int:
    url, model_id, inp, out = argv
    from kvpool.client import Client
    from kvpool.examples.models import load_smollm2
    from kvpool.gpu.hf import HFCacheConnector, generate_greedy

    job = torch.load(inp)
    model, _ = load_smollm2()
    results = []
    with Client(url) as client, HFCacheConnector(client, model.config,
                                                 model_id=model_id) as conn:
        for prompt in job["prompts"]:
            cache, loaded = conn.load(prompt)
            gen = generate_greedy(model, prompt, cache, job["steps"], start=loaded)
            results.append({"loaded": loaded, "tokens": gen.tokens, "logits": gen.logits})
    torch.save(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

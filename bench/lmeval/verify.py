"""Check the scores lm-evaluation-harness got from pdserve against a transformers forward of the same checkpoint.

python -m bench.lmeval.verify OUTPUT_DIR CHECKPOINT: OUTPUT_DIR holds lm-eval's `samples_pdserve_*.jsonl`
(`--log_samples`), CHECKPOINT the model folder pdserve served (for `tiny`: the pdserve cache's models/tiny-v1).
"""

from __future__ import annotations

import glob
import json
import sys

import torch
import transformers


class Reference:
    def __init__(self, checkpoint: str) -> None:
        self.tok = transformers.PreTrainedTokenizerFast.from_pretrained(checkpoint)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(log-probability of `continuation` after `context`, whether it is the greedy continuation)."""
        ids = context + continuation
        with torch.inference_mode():
            logp = self.model(torch.tensor([ids])).logits[0].log_softmax(-1)  # [L, V]
        rows, target = logp[len(context) - 1 : len(ids) - 1], torch.tensor(continuation)
        return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())

    def greedy_text(self, prompt: str, max_new: int, stops: list[str]) -> str:
        ids = self.encode(prompt)
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        text = self.tok.decode(out[0, len(ids) :], skip_special_tokens=True)
        return text[: min([i for i in map(text.find, stops) if i >= 0], default=len(text))]


def samples(out_dir: str, task: str) -> list[dict]:
    (path,) = glob.glob(f"{out_dir}/samples_{task}_*.jsonl")
    return [json.loads(line) for line in open(path)]


def main(out_dir: str, checkpoint: str) -> None:
    ref = Reference(checkpoint)
    worst = 0.0
    mc = samples(out_dir, "pdserve_mc")
    for doc in mc:
        for arg, resp in zip(doc["arguments"].values(), doc["resps"], strict=True):
            logprob, greedy = ref.score(ref.encode(arg["arg_0"]), ref.encode(arg["arg_1"]))
            worst = max(worst, abs(float(resp[0][0]) - logprob))
            assert (resp[0][1] == "True") == greedy, (resp, greedy)
    print(f"loglikelihood: {sum(len(d['resps']) for d in mc)} scores, max |pdserve - transformers| {worst:.1e}")
    prefix = ref.tok.bos_token_id if ref.tok.bos_token_id is not None else ref.tok.eos_token_id  # lm-eval's choice
    worst, rolling = 0.0, samples(out_dir, "pdserve_ppl")
    for doc in rolling:
        logprob, _ = ref.score([prefix], ref.encode(doc["arguments"]["gen_args_0"]["arg_0"]))
        worst = max(worst, abs(float(doc["resps"][0][0]) - logprob))
    print(f"loglikelihood_rolling: {len(rolling)} scores, max |pdserve - transformers| {worst:.1e}")
    gen = samples(out_dir, "pdserve_gen")
    for doc in gen:
        assert doc["resps"][0][0] == ref.greedy_text(doc["arguments"]["gen_args_0"]["arg_0"], 12, ["\n", "."]), doc
    print(f"generate_until: {len(gen)} answers, each transformers' greedy text cut at the first stop string")


if __name__ == "__main__":
    main(*sys.argv[1:])

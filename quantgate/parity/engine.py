"""Engine parity adapter: is the served engine computing the same model as transformers?

Sends the parity prompts to the server (greedy, `return_token_ids`) and runs transformers' greedy decoding from the
chat template's prompt tokens (`reference_run`: it needs no server, so a caller on a CPU computes it while the server
starts). The pure comparison is `quantgate.parity.core`; this module only produces the two token lists and writes
`parity.json`. A prompt whose server-side prompt tokens differ from the chat template
rendered by the tokenizer is reported too: a template mismatch is also an engine problem.

The reference runs where `quantize.devices.place` says: on the first visible GPU in the served dtype (vLLM's `auto`
resolved as vLLM resolves it), on the CPU in the served dtype or FP32 (CPU baselines serve FP32). `parity.json`
records the device and dtype it used.

`parity.json` is written whatever the verdict (the gate reads the current result), but only a pass is finished
work: `passed(folder)` is what a cache asks, so a failed check is run again next time instead of being kept. It is
written and read through `ParityRecord` (the ParityReport, then how and where the reference ran, and the texts).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantgate.base.runfiles import PARITY
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.http import Retry, for_each, post_json
from quantgate.base.paths import EVAL_SETS
from quantgate.base.typedfile import read_model
from quantgate.base.yamlconfig import load_model
from quantgate.parity.core import POLICY_FILE, ParityPolicy, ParityReport, check_parity
from quantgate.quantize.devices import Placement, place
from quantgate.quantize.preflight import checkpoint_dtype

PROMPTS_FILE = EVAL_SETS / "parity_prompts.yaml"
REPORT = PARITY


class ParityPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    messages: list[dict[str, str]] = Field(min_length=1)


class ParityPrompts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int
    max_tokens: int = Field(ge=1, le=512)
    prompts: list[ParityPrompt] = Field(min_length=1)


class PromptTexts(BaseModel):
    """A prompt's two greedy answers as text (special tokens skipped)."""
    model_config = ConfigDict(extra="allow")

    served: str
    reference: str


class ParityRecord(ParityReport):
    """parity.json: the ParityReport's fields, then how the reference ran and what each side answered. The fields
    after the report's are optional for a record of an older quantgate; a newer writer's keys are kept."""
    model_config = ConfigDict(extra="allow")

    dtype: str | None = Field(None, description="the dtype the reference ran in")
    served_dtype: str | None = Field(None, description="the server's --dtype (auto: vLLM's choice)")
    device: dict[str, object] | None = Field(None, description="where the reference ran (quantize.devices.Placement)")
    template_mismatch: list[str] = Field(default_factory=list, description="prompts whose served prompt tokens are "
                                                                           "not the chat template's")
    texts: dict[str, PromptTexts] = Field(default_factory=dict, description="prompt id -> both answers as text")

    def write(self, folder: Path) -> None:
        """Every field, None included, in the file's order."""
        write_json(Path(folder) / REPORT, self.model_dump())


def load_parity(folder: Path | str) -> ParityRecord:
    """The folder's parity.json, validated; RunFileError naming the file and field when it does not fit."""
    return read_model(Path(folder) / REPORT, ParityRecord, "engine parity record",
                      "it is written by the engine parity check; re-run the release to check the engine again")


def _token_ids(body: dict) -> tuple[list[int], list[int]]:
    return body["prompt_token_ids"], body["choices"][0]["token_ids"]


def served_greedy(base_url: str, api_key: str, model: str, prompts: list[ParityPrompt], max_tokens: int,
                  retries: int = 3) -> list[tuple[list[int], list[int]]]:
    """(prompt token ids, output token ids) per prompt from the server, all prompts in flight at once (the engine
    batches them, as it batches what it serves: on the FP32 CPU demo baseline the tokens are identical to one prompt
    at a time, in 1.7 s instead of 5.1 s); connection errors, timeouts, 5xx and 429 are retried
    (quantgate.base.http), any other failure is an error naming the prompt."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    retry = Retry(timeout_s=120.0, max_attempts=retries)

    async def ask(client, p: ParityPrompt) -> None:
        body = {"model": model, "messages": p.messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
                "return_token_ids": True}
        ans = await post_json(client, f"{base_url}/chat/completions", body, retry, parse=_token_ids)
        if not ans.ok:
            raise QuantgateError(f"parity prompt {p.id}: {ans.error}", where=base_url, fix="check the server log")
        out[p.id] = ans.value

    asyncio.run(for_each(prompts, ask, concurrency=max(1, len(prompts)), api_key=api_key))
    return [out[p.id] for p in prompts]


def reference_placement(model_dir: Path, served_dtype: str | None, gpus: str | None = None) -> Placement:
    """Where this process runs the reference for a model served with `served_dtype` (None or "auto": vLLM's auto)
    by a server on `gpus` (its CUDA_VISIBLE_DEVICES; None: not known)."""
    import torch

    cuda = torch.cuda.is_available()
    return place(cuda, torch.cuda.device_count() if cuda else 0, served_dtype, os.environ.get("CUDA_VISIBLE_DEVICES"),
                 checkpoint_dtype(model_dir), slot_devices=gpus)


def reference_greedy(model_dir: Path, prompt_ids: list[list[int]], max_tokens: int,
                     where: Placement) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids in, token ids out), on `where`'s device and dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    # transformers declares PreTrainedModel.to as @wraps(torch.nn.Module.to): typed as the unbound function
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, where.dtype)).to(where.device)  # type: ignore[arg-type]
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids], device=where.device)
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _strip_end(tokens: list[int], end_ids: set[int]) -> list[int]:
    while tokens and tokens[-1] in end_ids:
        tokens = tokens[:-1]
    return tokens


def passed(out_dir: Path) -> bool:
    """True when `out_dir`/parity.json holds a passing verdict (reusable); a fail, a torn, missing or unreadable
    file: False."""
    try:
        return ParityRecord.model_validate_json((Path(out_dir) / REPORT).read_bytes()).verdict == "pass"
    except (OSError, ValidationError):
        return False


class Reference(NamedTuple):
    """transformers' side of the check, which needs no server: a caller may compute it while the server starts."""
    prompt_ids: list[list[int]]  # each prompt through the model's chat template
    outputs: list[list[int]]     # transformers' greedy continuation of each
    where: Placement
    tokenizer: Any               # the model's tokenizer, loaded once: the check decodes and strips with it


def reference_run(model_dir: Path, dtype: str | None = "auto", prompts_file: Path = PROMPTS_FILE,
                  gpus: str | None = None) -> Reference:
    """The reference for a model served with `dtype` on `gpus` (its CUDA_VISIBLE_DEVICES; the reference then uses
    their first GPU: quantize.devices.place), from the chat template's prompt tokens."""
    from transformers import AutoTokenizer

    prompts = load_model(prompts_file, ParityPrompts)
    tok = AutoTokenizer.from_pretrained(model_dir)
    templated = [list(tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=False))
                 for p in prompts.prompts]
    where = reference_placement(model_dir, dtype, gpus)
    return Reference(templated, reference_greedy(model_dir, templated, prompts.max_tokens, where), where, tok)


def run_parity(model_dir: Path, base_url: str, api_key: str, served_name: str, out_dir: Path,
               dtype: str | None = "auto", prompts_file: Path = PROMPTS_FILE, policy_file: Path = POLICY_FILE,
               gpus: str | None = None, reference: Reference | None = None) -> ParityReport:
    """Engine parity of a served model (`dtype`: its --dtype, `gpus`: its CUDA_VISIBLE_DEVICES); `reference`: the
    reference_run of the same arguments when the caller computed it already.

    The reference decodes from the chat template's prompt tokens. They must be the server's own: a prompt whose
    served tokens differ is a template mismatch, which fails the check whatever the answers."""
    prompts = load_model(prompts_file, ParityPrompts)
    policy = load_model(policy_file, ParityPolicy)
    served = served_greedy(base_url, api_key, served_name, prompts.prompts, prompts.max_tokens)
    ref = reference or reference_run(model_dir, dtype, prompts_file, gpus)
    template_mismatch = [p.id for p, t, (sp, _) in zip(prompts.prompts, ref.prompt_ids, served) if t != list(sp)]
    tok, where = ref.tokenizer, ref.where
    end_ids = {i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None}
    report = check_parity([_strip_end(list(o), end_ids) for _, o in served], [_strip_end(r, end_ids) for r in ref.outputs],
                          policy, [p.id for p in prompts.prompts])
    if template_mismatch:
        report = report.model_copy(update={"verdict": "fail", "reason": f"engine problem: the server's prompt tokens differ from the "
                                           f"model's chat template for {template_mismatch}; {report.reason}"})
    decode = tok.decode
    ParityRecord(
        **dict(report), dtype=where.dtype, served_dtype=dtype or "auto", device=where.as_record(),
        template_mismatch=template_mismatch,
        texts={p.id: PromptTexts(served=decode(o, skip_special_tokens=True), reference=decode(r, skip_special_tokens=True))
               for p, (_, o), r in zip(prompts.prompts, served, ref.outputs)},
    ).write(out_dir)
    return report

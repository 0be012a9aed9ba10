"""Ground-truth evaluation: task success of sampled responses on held-out prompts."""

from __future__ import annotations

from typing import Any

import torch

from rlhf.data.batching import pad_left
from rlhf.data.rendering import render_prompt
from rlhf.data.tokenization import encode_prompt
from rlhf.engine.distributed import DistributedContext
from rlhf.data.formats import Message
from rlhf.engine.generation import generate
from rlhf.engine.multi_turn import generate_turns
from rlhf.engine.sampling import SamplingParams
from rlhf.models.checks import check_tokenizer_fits
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.seeding import derive_seed
from rlhf.stages.tool_rollouts import ToolRollout, ToolSetup


@torch.no_grad()
def task_success(
    model_dir: str, task: Any, prompts: list[str], ctx: DistributedContext, temperature: float = 1.0,
    max_new_tokens: int = 32, batch_size: int = 64, seed: int = 0, tools: ToolSetup | None = None,
    chat_template: str | None = None,
) -> float:
    """Mean task score of responses sampled at `temperature` (each rank takes a share of the prompts).
    With `tools`, each prompt is answered in turns, the tools' calls run (stages/tool_rollouts.py);
    `chat_template`: a template file replacing the model's (one that renders the tools)."""
    tokenizer = load_tokenizer(model_dir, chat_template=chat_template)
    check_tokenizer_fits(tokenizer, model_dir, "--model")
    model = load_causal_lm(model_dir).to(ctx.device).eval()
    mine = prompts[ctx.rank :: ctx.world_size]
    params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                            temperature=max(temperature, 1e-6), eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    # The same stream for every model evaluated with this seed: SFT and PPO are compared on equal draws.
    generator = torch.Generator(device=ctx.device).manual_seed(derive_seed(seed, "task_success", ctx.rank))
    total = 0.0
    for start in range(0, len(mine), batch_size):
        texts = mine[start : start + batch_size]
        messages: list[list[Message]] = [[{"role": "user", "content": t}] for t in texts]
        if tools is not None:
            rollout = ToolRollout(tools, tokenizer, messages, [{} for _ in texts])
            input_ids, mask = pad_left(rollout.prompt_ids(), tokenizer.pad_token_id)
            generate_turns(model, input_ids.to(ctx.device), mask.to(ctx.device), params, generator, rollout.respond)
            total += sum(task.score(text, response) for text, response in zip(texts, rollout.responses))
            continue
        ids = [encode_prompt(render_prompt(m, tokenizer), tokenizer) for m in messages]
        input_ids, mask = pad_left(ids, tokenizer.pad_token_id)
        out = generate(model, input_ids.to(ctx.device), mask.to(ctx.device), params, generator)
        for text, seq, action in zip(texts, out.sequences, out.action_mask):
            response = tokenizer.decode(seq[action], skip_special_tokens=True).strip()
            total += task.score(text, response)
    sums = ctx.all_reduce_sum(torch.tensor([total, float(len(mine))], dtype=torch.float64))
    return float(sums[0] / sums[1].clamp(min=1))

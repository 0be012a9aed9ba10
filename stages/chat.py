"""`rlhf chat`: talk to any stage's model (interactive, or one-shot with --prompt).

A causal LM (sft/ppo output) answers; a reward/value model (reward output) scores each exchange
you type as "prompt ||| response".
"""

from __future__ import annotations


import click
import torch

from rlhf.data.batching import pad_left
from rlhf.data.rendering import render_prompt, render_response
from rlhf.data.tokenization import encode_continuation, encode_prompt
from rlhf.engine.generation import generate
from rlhf.engine.sampling import SamplingParams
from rlhf.errors import UserError
from rlhf.models.checks import check_tokenizer_fits
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.value_model import is_value_model_dir, load_value_model


def chat(model_dir: str, prompt: str | None, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> None:
    tokenizer = load_tokenizer(model_dir)
    check_tokenizer_fits(tokenizer, model_dir, "--model")
    if is_value_model_dir(model_dir):
        scorer = load_value_model(model_dir, flag="--model").eval()

        def answer(history: list[dict[str, str]], text: str) -> str:
            if "|||" not in text:
                raise UserError("a reward model scores an exchange: type 'prompt ||| response'")
            user, response = (part.strip() for part in text.split("|||", 1))
            msgs = [{"role": "user", "content": user}]
            ids = encode_prompt(render_prompt(msgs, tokenizer), tokenizer) + encode_continuation(
                render_response(msgs, response, tokenizer), tokenizer)
            with torch.no_grad():
                score = scorer.score(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
            return f"score: {float(score):.4f}"
    else:
        model = load_causal_lm(model_dir).eval()
        generator = torch.Generator().manual_seed(seed)
        params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                temperature=max(temperature, 1e-6), top_p=top_p,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

        def answer(history: list[dict[str, str]], text: str) -> str:
            history.append({"role": "user", "content": text})
            ids, mask = pad_left([encode_prompt(render_prompt(history, tokenizer), tokenizer)], tokenizer.pad_token_id)
            out = generate(model, ids, mask, params, generator)
            reply = tokenizer.decode(out.sequences[0][out.action_mask[0]], skip_special_tokens=True).strip()
            history.append({"role": "assistant", "content": reply})
            return reply

    history: list[dict[str, str]] = []
    if prompt is not None:
        click.echo(answer(history, prompt))
        return
    click.echo(f"chatting with {model_dir}; empty line or Ctrl-D quits, /reset clears the history")
    while True:
        try:
            text = input("you> ")
        except EOFError:
            break
        if not text.strip():
            break
        if text.strip() == "/reset":
            history.clear()
            continue
        click.echo(f"model> {answer(history, text)}")

"""Tokens by string: a token a user names (``" Paris"``) and prompts given as text,
turned into the ids a model reads."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headlab.errors import UserError


def token_id(tokenizer, token: str | int) -> tuple[int, str]:
    """The id of a one-token string (or an id as given) and its text."""
    if isinstance(token, int):
        return token, tokenizer.decode([token]) if tokenizer is not None else str(token)
    if tokenizer is None:
        raise UserError(f"token {token!r} given as text, but there is no tokenizer to read "
                        "it: give its id, or a model with a tokenizer")
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise UserError(f"{token!r} is {len(ids)} tokens for this tokenizer; target and foil "
                        "must be one token each (mind the leading space, e.g. ' Paris')")
    return ids[0], token


def token_ids(tokenizer, tokens: torch.Tensor | int | str | Sequence[int | str]) -> torch.Tensor:
    """Ids (N,) of tokens given as ids, one-token strings, or a mix."""
    if isinstance(tokens, torch.Tensor):
        return tokens.reshape(-1).long()
    items = [tokens] if isinstance(tokens, int | str) else list(tokens)
    return torch.tensor([token_id(tokenizer, t)[0] for t in items], dtype=torch.long)


def prompt_ids(tokenizer, prompts: torch.Tensor | str | Sequence[str]) -> torch.Tensor:
    """Input ids (N, S) of prompts given as ids or as text (each the same number of
    tokens, as patching pairs must be)."""
    if isinstance(prompts, torch.Tensor):
        return prompts
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if tokenizer is None:
        raise UserError("prompts given as text, but the model has no tokenizer: give ids")
    rows = [tokenizer(t)["input_ids"] for t in texts]
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        raise UserError(f"the prompts are {sorted(lengths)} tokens long; give prompts of the "
                        "same number of tokens (or ids)")
    return torch.tensor(rows, dtype=torch.long)

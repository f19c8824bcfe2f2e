"""From sampled tokens to what a caller sees (vLLM's output processor): stop rules, text,
log-probabilities and the ``RequestOutput`` of a request."""

from __future__ import annotations

from research.engine.executor import decode_logprobs
from research.engine.request import RequestOutput
from research.engine.sequence import Sequence
from research.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos = eos_token_ids

    def append_and_check_stop(self, seq: Sequence, token: int) -> None:
        """vLLM's stop rules: the token is always kept in ``token_ids`` (EOS included); the
        length cap is checked first, then EOS (``stop_reason`` None), then stop token ids
        (``stop_reason`` the token); a stop string found in the text overrides them all and cuts
        the text there. A token that stopped the request is left out of its text."""
        sp = seq.sampling_params
        seq.output_token_ids.append(token)
        if len(seq.output_token_ids) >= sp.max_tokens:
            seq.finish_reason = "length"
        elif not sp.ignore_eos and token in self.eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in sp.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        if sp.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(self.text_ids(seq), sp.skip_special_tokens)
            hit = next((s for s in sp.stop if s in text), None)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = "stop", hit
                seq.output_text = text[: text.index(hit)]

    @staticmethod
    def text_ids(seq: Sequence) -> list[int]:
        """The output tokens that make its text: all but a final EOS or stop token."""
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str):
            return seq.output_token_ids[:-1]
        return seq.output_token_ids

    def token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def prompt_logprobs(self, seq: Sequence) -> list | None:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then a dict per token;
        decoded once, when the whole prompt has been computed."""
        n = seq.sampling_params.prompt_logprobs
        if n is None or seq.prompt_logprobs is not None:
            return seq.prompt_logprobs
        prompt = seq.prompt_token_ids
        if any(p not in seq.prompt_logprobs_raw for p in range(1, len(prompt))):
            return None  # still prefilling (or stopped before it finished)
        raw = seq.prompt_logprobs_raw
        seq.prompt_logprobs = [None] + [
            decode_logprobs(raw[p], prompt[p], n, self.token_text) for p in range(1, len(prompt))
        ]
        seq.prompt_logprobs_raw = {}
        return seq.prompt_logprobs

    def output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text
        # Text is decoded once, at the end; streaming callers decode token ids themselves.
        if self.tokenizer is not None and seq.is_finished and not isinstance(seq.stop_reason, str):
            text = self.tokenizer.decode(
                self.text_ids(seq), seq.sampling_params.skip_special_tokens
            )
            seq.output_text = text
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            stop_reason=seq.stop_reason,
            top2_logit_gaps=list(seq.top2_gaps),
            num_preemptions=seq.num_preemptions,
            logprobs=None if seq.sampling_params.logprobs is None else list(seq.logprobs),
            prompt_logprobs=self.prompt_logprobs(seq),
        )

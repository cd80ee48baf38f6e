"""RequestDecoder on scripted logits over the tiny byte-level tokenizer (one token per byte:
id = 3 + byte; <|im_end|> = 2 is EOS), so that every token and every character is known."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.engine.decoder import RequestDecoder
from kvstrata.engine.grammar import GrammarCompiler, GrammarSpec
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.stops import IncrementalText, StopStrings
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer

EOS = 2
VOCAB = TINY_VOCAB_SIZE
TOKENIZER = tiny_tokenizer()


def ids(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


def prefer(*tokens: int) -> torch.Tensor:
    """Logits that rank ``tokens`` first, second, ... (all others far below)."""
    row = torch.full((VOCAB,), -10.0)
    for rank, token in enumerate(tokens):
        row[token] = 10.0 - rank
    return row


def decoder(grammars: GrammarCompiler | None = None, **params: object) -> RequestDecoder:
    return RequestDecoder(
        SamplingParams(**params),  # type: ignore[arg-type]
        TOKENIZER,
        eos_token_ids={EOS},
        vocab_size=VOCAB,
        grammars=grammars,
    )


def run(dec: RequestDecoder, script: list[int]) -> list[str]:
    """Feed the model's preferred tokens one by one; the text deltas released."""
    deltas = []
    for token in script:
        step = dec.accept(dec.choose(prefer(token)))
        deltas.append(step.text)
        if step.finish_reason:
            break
    return deltas


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, VOCAB, EOS)


def test_stop_string_ends_the_text_before_it_and_never_streams_a_part_of_it() -> None:
    dec = decoder(stop=("STOP", "halt"), max_tokens=40)
    deltas = run(dec, ids("Hello ST STOP more"))
    assert dec.text == "Hello ST " and "".join(deltas) == dec.text
    assert dec.finish_reason == "stop" and dec.stop_reason == "STOP"
    # "S", then "ST" could begin STOP: held back until the space shows they do not
    assert deltas[:9] == ["H", "e", "l", "l", "o", " ", "", "", "ST "]
    assert len(dec.token_ids) == len("Hello ST STOP")  # the tokens were generated; the text stops


def test_the_earliest_stop_string_wins_and_a_stop_may_span_tokens() -> None:
    dec = decoder(stop=("cd", "bcd"))
    run(dec, ids("abcdef"))
    assert (dec.text, dec.stop_reason) == ("a", "bcd")


def test_held_back_text_is_released_when_the_output_ends_otherwise() -> None:
    dec = decoder(stop=("STOP",), max_tokens=4)
    deltas = run(dec, ids("abST"))
    assert dec.finish_reason == "length" and dec.text == "abST" and deltas[-1] == "ST"
    eos = decoder(stop=("STOP",))
    assert "".join(run(eos, [*ids("abS"), EOS])) == "abS" and eos.finish_reason == "stop"
    assert eos.stop_reason is None  # EOS, not a stop string


def test_stop_token_ids_end_the_output_and_their_text_is_dropped() -> None:
    dec = decoder(stop_token_ids=tuple(ids("!")))
    run(dec, ids("Hi! there"))
    assert (dec.text, dec.finish_reason, dec.stop_reason) == ("Hi", "stop", ids("!")[0])


def test_min_tokens_bans_eos_and_stop_strings_until_reached() -> None:
    dec = decoder(min_tokens=3, stop=("b",))
    # the model wants EOS at once; it is banned for three tokens, then taken
    assert dec.choose(prefer(EOS, *ids("x"))).token == ids("x")[0]
    dec.accept(ids("b")[0])  # a stop string under min_tokens does not stop
    dec.accept(ids("x")[0])
    dec.accept(ids("y")[0])
    assert not dec.finished and dec.choose(prefer(EOS)).token == EOS
    assert dec.accept(EOS).finish_reason == "stop" and dec.text == "bxy"


def test_ignore_eos_generates_to_max_tokens() -> None:
    dec = decoder(ignore_eos=True, max_tokens=3)
    run(dec, [EOS, EOS, EOS])
    assert dec.finish_reason == "length" and dec.token_ids == [EOS, EOS, EOS] and dec.text == ""


def test_stop_token_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        decoder(stop_token_ids=(VOCAB,))


def test_utf8_characters_split_over_tokens_are_released_whole() -> None:
    dec = decoder()
    deltas = run(dec, ids("é!"))
    assert deltas == ["", "é", "!"] and dec.text == "é!"


def test_incremental_text_matches_a_full_decode() -> None:
    text = IncrementalText(TOKENIZER)
    tokens = [*ids("héllo"), 1, *ids(" wörld")]  # a special token in between is skipped
    assert "".join(text.add(t) for t in tokens) + text.flush() == TOKENIZER.decode(
        tokens, skip_special_tokens=True
    )


def test_stop_strings_find_and_hold_back() -> None:
    stops = StopStrings(["abc", "xy"])
    assert stops.find("__abc", 1) == (2, "abc")  # ends in the new text
    assert stops.find("abc__", 2) is None  # ended before it: already searched
    assert [stops.holdback(t) for t in ("zzab", "zzx", "zza", "zzq")] == [2, 1, 1, 0]


def test_a_grammar_forces_valid_json_whatever_the_model_prefers(grammars: GrammarCompiler) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    dec = decoder(grammars, grammar=GrammarSpec.json_schema(schema), max_tokens=60)
    # the "model" wants EOS, then "x", then "2" above anything else
    while not dec.finished:
        dec.accept(dec.choose(prefer(EOS, *ids("x2t"))))
    assert dec.text == '{"ok": true, "n": 22}'
    assert json.loads(dec.text) == {"ok": True, "n": 22} and dec.finish_reason == "stop"
    assert EOS not in dec.token_ids  # the complete grammar ended the output itself


def test_min_tokens_yields_to_a_complete_grammar(grammars: GrammarCompiler) -> None:
    dec = decoder(grammars, grammar=GrammarSpec.lark('start: "ok"'), min_tokens=5, max_tokens=8)
    run(dec, [*ids("ok"), EOS])
    assert dec.text == "ok" and dec.finish_reason == "stop"


def test_an_invalid_grammar_is_a_config_error(grammars: GrammarCompiler) -> None:
    with pytest.raises(ConfigError, match="invalid JSON schema"):
        decoder(grammars, grammar=GrammarSpec.json_schema({"type": "objectx"}))
    with pytest.raises(ConfigError, match="invalid grammar"):
        decoder(grammars, grammar=GrammarSpec.lark("start: nowhere"))
    with pytest.raises(ConfigError, match="no grammar compiler"):
        decoder(None, grammar=GrammarSpec.json_schema(None))


def test_constraints_are_per_request(grammars: GrammarCompiler) -> None:
    """Two requests decoded in lockstep (as a batch would) with different constraints."""
    digits = decoder(grammars, grammar=GrammarSpec.lark("start: /[0-9]{3}/"), max_tokens=10)
    free = decoder(max_tokens=3)
    for _ in range(3):
        row = prefer(*ids("a7"))
        digits.accept(digits.choose(row))
        free.accept(free.choose(row))
    assert (digits.text, free.text) == ("777", "aaa")

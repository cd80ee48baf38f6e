"""Evaluation harnesses: measurements of kvstrata's parts on a real model (not tests)."""

from kvstrata.eval.codec_quality import CodecQuality, eval_text, eval_token_ids, evaluate_codecs

__all__ = ["CodecQuality", "eval_text", "eval_token_ids", "evaluate_codecs"]

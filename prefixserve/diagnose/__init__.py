"""Cache-miss diagnosis: lint request logs, replay them through the KV cache, explain misses live.

Everything here runs on the engine's own kv code and tokenizer, so a simulated hit is exactly
an engine hit.
"""
from prefixserve.diagnose.divergence import ClosestPrefixIndex, Divergence
from prefixserve.diagnose.lint import LintReport, lint
from prefixserve.diagnose.live import Diagnosis, MissExplainer
from prefixserve.diagnose.log_reader import LogFormatError, LogRecord, read_log
from prefixserve.diagnose.render import RenderedRequest, Renderer, Span, load_renderer
from prefixserve.diagnose.replay import ReplayConfig, ReplayRequest, ReplayResult, replay
from prefixserve.diagnose.rules import RULE_IDS
from prefixserve.prompt import common_prefix_len

__all__ = ["ClosestPrefixIndex", "Diagnosis", "Divergence", "LintReport", "LogFormatError",
           "LogRecord", "MissExplainer", "RULE_IDS", "RenderedRequest", "Renderer",
           "ReplayConfig", "ReplayRequest", "ReplayResult", "Span", "common_prefix_len", "lint",
           "load_renderer", "read_log", "replay"]

"""Cache-miss rules: one file per rule; RULES lists them in reporting order."""
from prefixserve.diagnose.rules.base import Finding, Pair, Rule
from prefixserve.diagnose.rules.changed_image import ChangedImage
from prefixserve.diagnose.rules.dynamic_system import DynamicSystem
from prefixserve.diagnose.rules.history_rewrite import HistoryRewrite
from prefixserve.diagnose.rules.history_truncation import HistoryTruncation
from prefixserve.diagnose.rules.reserialized_json import ReserializedJson
from prefixserve.diagnose.rules.short_prefix import ShortPrefix
from prefixserve.diagnose.rules.template_rewrite import TemplateRewrite
from prefixserve.diagnose.rules.tool_order import ToolOrder, canonical_tools
from prefixserve.diagnose.rules.volatile_prefix import VolatilePrefix
from prefixserve.diagnose.rules.whitespace_drift import WhitespaceDrift

RULES: tuple[Rule, ...] = (DynamicSystem(), HistoryRewrite(), HistoryTruncation(), ReserializedJson(),
                           TemplateRewrite(), ToolOrder(), WhitespaceDrift(), ShortPrefix(),
                           VolatilePrefix(), ChangedImage())
RULE_IDS: tuple[str, ...] = tuple(rule.id for rule in RULES)
RULES_BY_ID: dict[str, Rule] = {rule.id: rule for rule in RULES}

__all__ = ["Finding", "Pair", "Rule", "RULES", "RULE_IDS", "RULES_BY_ID", "canonical_tools"]

"""Tool calls: the formats models write them in, parsed from finished text or incrementally while
streaming (`calls`, `streaming`), and the checks and grammars of a request's tools and
tool_choice (`choice`, which needs the grammar library). Entry points turn them into OpenAI
tool_calls and Anthropic tool_use blocks; diagnose reads calls out of logged replies."""
from prefixserve.tools.calls import ToolCall, ToolFormat, ToolSpec, format_of_template, parse_tool_calls
from prefixserve.tools.streaming import ToolCallStream, ToolEvent

__all__ = ["ToolCall", "ToolFormat", "ToolSpec", "format_of_template", "parse_tool_calls",
           "ToolCallStream", "ToolEvent"]

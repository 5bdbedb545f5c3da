"""Live cache-miss diagnosis on the server: who asked for it, the parts of a chat prompt, and the
`diagnosis` entry of the response's `prefixserve` extension object.

Every finished request is remembered by the app's MissExplainer under the response id the
client saw, so a later request can name it in `diagnose_against`. Requests are compared only
within their cache salt: another tenant's prompt text never appears in a diagnosis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from prefixserve.diagnose.live import MissExplainer, expanded_spans
from prefixserve.engine.outputs import RequestOutput
from prefixserve.entrypoints.server.errors import bad_request
from prefixserve.entrypoints.server.protocol import DiagnoseFields
from prefixserve.prompt import Span


@dataclass(frozen=True)
class DiagnoseAsk:
    """A request asked for its diagnosis; `against` is the earlier response id to compare with
    (None: the remembered request sharing the longest prefix)."""
    against: Optional[str] = None


def diagnose_ask(body: DiagnoseFields) -> Optional[DiagnoseAsk]:
    """What the body asks (None: no diagnosis); a 400 naming the field for contradictions."""
    nested = body.prefixserve
    top, inner = body.diagnose_against, nested.diagnose_against if nested else None
    if top is not None and inner is not None and top != inner:
        raise bad_request(f"diagnose_against is {top!r} but prefixserve.diagnose_against is "
                          f"{inner!r}; give one", param="diagnose_against")
    against = top if top is not None else inner
    if against is not None and not against:
        raise bad_request("diagnose_against must be a non-empty response id",
                          param="diagnose_against" if top is not None
                          else "prefixserve.diagnose_against")
    if against is None and not body.diagnose and not (nested and nested.diagnose):
        return None
    return DiagnoseAsk(against)


@dataclass(frozen=True)
class LiveDiagnosis:
    """One HTTP request's part in live diagnosis."""
    explainer: MissExplainer
    ask: Optional[DiagnoseAsk]
    cache_salt: Optional[str]
    spans: Optional[list[Span]] = None
    # whose request it is: the explainer's memory is shared out per tenant
    tenant: Optional[str] = None

    def finish(self, request_id: str, output: RequestOutput) -> Optional[dict[str, Any]]:
        """Remembers a finished request; returns its diagnosis when it was asked for."""
        images = output.image_spans
        if self.ask is None:
            self.explainer.remember(request_id, output.prompt_token_ids, cache_salt=self.cache_salt,
                                    images=images, tenant=self.tenant)
            return None
        spans = expanded_spans(self.spans, images) if self.spans and images else self.spans
        return self.explainer.explain(
            request_id, output.prompt_token_ids, cache_salt=self.cache_salt,
            num_cached_tokens=output.num_cached_tokens, spans=spans,
            diagnose_against=self.ask.against, images=images, tenant=self.tenant).to_dict()


def with_diagnosis(report: Optional[dict[str, Any]], diagnosis: Any) -> Optional[dict[str, Any]]:
    """The `prefixserve` extension object: the cache breakpoint report plus the diagnosis."""
    if diagnosis is None:
        return report
    return {**(report or {}), "diagnosis": diagnosis}

"""Optional LLM explanation (off by default): an OpenAI-compatible chat endpoint may rephrase the
verdict for humans, but it never chooses the decision, and its text is kept only when every line
it cites is verified against the analysed files.

Follows: NVRx restart agent L1 (model view of the evidence) and L2 (grounding of citations).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx

from trainguard._core.logging import get_logger

__all__ = ["LlmExplainer", "verify_citations"]

_log = get_logger("trainguard.attribution.llm")
_SYSTEM = (
    "You explain training-job failures. Answer with one JSON object: {\"explanation\": one or two "
    "sentences, \"citations\": [{\"file\": path, \"line\": number, \"quote\": exact text copied "
    "from that line}]}. Cite only lines shown to you. Do not propose a different decision.")
_MIN_QUOTE = 8


def _read_line(path: str, line: int) -> str | None:
    try:
        with open(path, "rb") as fh:
            raw = next(itertools.islice(fh, line - 1, line), None)
    except OSError:
        return None
    return raw.decode("utf-8", "replace") if raw is not None else None


def verify_citations(citations: Any, files: list[str]) -> tuple[list[dict], list[str]]:
    """Check each ``{file, line, quote}``: the file is one of ``files`` and the quote (at least
    8 characters) appears verbatim on that line. Returns (verified, problems)."""
    ok, problems = [], []
    if not isinstance(citations, list) or not citations:
        return [], ["no citations"]
    for c in citations:
        if not isinstance(c, dict) or c.get("file") not in files or not isinstance(
                c.get("line"), int) or c["line"] < 1:
            problems.append(f"citation {c!r} does not name an analysed file and line")
            continue
        quote = str(c.get("quote", "")).strip()
        text = _read_line(c["file"], c["line"])
        if len(quote) < _MIN_QUOTE or text is None or quote not in text:
            problems.append(f"quote not found at {c['file']}:{c['line']}")
            continue
        ok.append({"file": c["file"], "line": c["line"], "quote": quote})
    return ok, problems


class LlmExplainer:
    """Client of an OpenAI-compatible ``/chat/completions`` endpoint.

    Args:
        base_url: e.g. ``http://127.0.0.1:8001/v1``.
        model: model name sent to the endpoint.
        api_key: bearer token, if the endpoint needs one.
        timeout_s: request timeout (seconds).
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s

    def _prompt(self, result: dict[str, Any]) -> str:
        lines = [f"{e['file']}:{e['line']}: {e['text']}" for e in result.get("evidence", [])[:20]]
        return (f"Verdict: {result['primary_category']} ({result['failure_domain']}), decision "
                f"{result['decision']}. Culprit ranks {result.get('culprit_ranks')}, nodes "
                f"{result.get('culprit_nodes')}.\nEvidence lines:\n" + "\n".join(lines))

    def explain(self, result: dict[str, Any]) -> dict[str, Any]:
        """Ask for an explanation of ``result`` (an ``AnalysisResult.to_dict()``).

        Returns ``{"explanation": str | None, "citations": [...], "verified": bool,
        "problems": [...]}``; ``explanation`` is None unless every citation verified. Never
        raises for endpoint or format errors (they are reported in ``problems``).
        """
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "temperature": 0,
                "messages": [{"role": "system", "content": _SYSTEM},
                             {"role": "user", "content": self._prompt(result)}]}
        try:
            resp = httpx.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
            resp.raise_for_status()
            content = resp.json()["choices"][0]["message"]["content"]
            answer = json.loads(content)
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            _log.warning("LLM explanation unavailable: %s", exc)
            return {"explanation": None, "citations": [], "verified": False,
                    "problems": [f"endpoint error: {exc}"]}
        cites, problems = verify_citations(answer.get("citations") if isinstance(answer, dict)
                                           else None, list(result.get("files", [])))
        verified = bool(cites) and not problems
        text = answer.get("explanation") if isinstance(answer, dict) else None
        return {"explanation": str(text) if verified and text else None, "citations": cites,
                "verified": verified, "problems": problems}

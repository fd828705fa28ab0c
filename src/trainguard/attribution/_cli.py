"""``trainguard analyze`` and ``trainguard attrsvc`` sub-commands."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["register"]

_EXIT_BAD_INPUT = 2


def register(subparsers) -> list[str]:
    """Add ``analyze`` and ``attrsvc`` to the ``trainguard`` command line."""
    p = subparsers.add_parser("analyze", help="attribute a failed run from its logs and/or "
                              "flight-recorder dumps")
    p.add_argument("logs", nargs="*", metavar="LOG", help="log files of one attempt")
    p.add_argument("--fr-dir", help="flight-recorder dumps (directory or file prefix)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--history", help="earlier cycles' `analyze --json` outputs (JSON list or "
                   "JSON lines), oldest first")
    p.add_argument("--registry", help="pattern registry YAML replacing the shipped one")
    p.add_argument("--ended", action="store_true",
                   help="the job has ended (a log without failure is then 'unknown')")
    p.add_argument("--same-root-limit", type=int, default=3,
                   help="cycles with the same failure and no progress before STOP (default 3)")
    p.add_argument("--llm-url", help="optional OpenAI-compatible endpoint (e.g. http://host/v1) "
                   "that rephrases the verdict; key from TRAINGUARD_LLM_API_KEY; off by default")
    p.add_argument("--llm-model", default="default", help="model name for --llm-url")
    p.set_defaults(func=_analyze)

    s = subparsers.add_parser("attrsvc", help="run the attribution HTTP service")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--allowed-root", action="append", required=True,
                   help="directory whose logs may be analysed (repeatable)")
    s.add_argument("--api-key-file", help="file with one API key per line (or set "
                   "TRAINGUARD_ATTRSVC_API_KEYS=key1,key2)")
    s.add_argument("--db", default="sqlite:///attrsvc.db", help="sqlite:///PATH result store")
    s.add_argument("--rate-limit", type=int, default=600, help="requests/minute per client")
    s.add_argument("--max-body", type=int, default=64 * 1024, help="max request body (bytes)")
    s.add_argument("--workers", type=int, default=2, help="concurrent analyses")
    s.add_argument("--jsonl", help="append every result to this JSON-lines file")
    s.add_argument("--webhook", help="POST every result to this URL (3 tries with backoff)")
    s.add_argument("--slack-webhook", help="Slack incoming-webhook URL (STOP verdicts only)")
    s.set_defaults(func=_attrsvc)
    return ["analyze", "attrsvc"]


def _run_analysis(args) -> dict[str, Any]:
    from trainguard.attribution._agent import RestartPolicy, decide, load_history
    from trainguard.attribution._analyze import analyze_logs
    from trainguard.attribution._flight_recorder import analyze_flight_recorder

    if not args.logs and not args.fr_dir:
        raise ValueError("give at least one LOG file or --fr-dir")
    out: dict[str, Any] = {}
    if args.logs:
        out = analyze_logs(args.logs, registry_path=args.registry, job_ended=args.ended).to_dict()
        history = load_history(args.history) if args.history else []
        verdict = decide(out, history, RestartPolicy(same_root_limit=args.same_root_limit))
        out["category_decision"] = out["decision"]
        out["decision"], out["reason"] = verdict.decision, verdict.reason
        out["agent"] = verdict.to_dict()
        if args.llm_url:
            from trainguard.attribution._llm import LlmExplainer

            out["llm"] = LlmExplainer(args.llm_url, args.llm_model,
                                      os.environ.get("TRAINGUARD_LLM_API_KEY")).explain(out)
    if args.fr_dir:
        fr = out["flight_recorder"] = analyze_flight_recorder(args.fr_dir).to_dict()
        if out.get("primary_category") == "collective_timeout" and not out["culprit_ranks"] \
                and fr["faulty_ranks"]:
            # the log cannot say who hung; the dumps can
            out["culprit_ranks"] = fr["faulty_ranks"]
            out["reason"] += f" Flight recorder: ranks {fr['faulty_ranks']} are stuck."
    return out


def _analyze(args) -> int:
    from trainguard.errors import TrainguardError

    try:
        out = _run_analysis(args)
    except (TrainguardError, ValueError) as exc:
        print(f"trainguard analyze: error: {exc}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        _print_report(out)
    return 0


def _print_report(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(highlight=False)
    if "primary_category" in out:
        con.print(f"[bold]Root cause:[/bold] {out['primary_category']} "
                  f"([italic]{out['failure_domain']}[/italic]), confidence {out['confidence']}")
        if out["culprit_ranks"] or out["culprit_nodes"]:
            con.print(f"  ranks: {out['culprit_ranks']}  nodes: {out['culprit_nodes']}")
        table = Table("file:line", "role", "text", show_lines=False)
        for ev in out["evidence"]:
            table.add_row(escape(f"{os.path.basename(ev['file'])}:{ev['line']}"), ev["role"],
                          escape(ev["text"][:160]))
        con.print(table)
        for c in out["cascades"]:
            con.print(f"  cascade: {c['category']} x{c['count']} on ranks {c['ranks']}")
        prog = out["progress"]
        con.print(f"  progress: last step {prog['last_step']}, checkpoint saved "
                  f"{prog['checkpoint_saved']} (step {prog['last_checkpoint_step']})")
        con.print(f"[bold]Decision:[/bold] {out['decision']} - {escape(out['reason'])}")
    fr = out.get("flight_recorder")
    if fr:
        stuck = fr["first_stuck"] or {}
        con.print(f"[bold]Flight recorder:[/bold] faulty ranks {fr['faulty_ranks']} "
                  f"(never joined {fr['missing_ranks']}, joined but not completed "
                  f"{fr['incomplete_ranks']}); first stuck: {stuck.get('op')} seq "
                  f"{stuck.get('collective_seq_id')} in {stuck.get('pg_desc')} "
                  f"(pg {stuck.get('pg_name')}); {len(fr['mismatches'])} mismatch(es)")


def _keys(args) -> list[str]:
    keys = [k for k in os.environ.get("TRAINGUARD_ATTRSVC_API_KEYS", "").split(",") if k.strip()]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as fh:
            keys += [line.strip() for line in fh if line.strip()]
    return keys


def _attrsvc(args) -> int:
    import uvicorn

    from trainguard.attribution._agent import RestartPolicy
    from trainguard.attribution._posting import JsonlPoster, SlackPoster, WebhookPoster
    from trainguard.attribution._service import create_app
    from trainguard.attribution._svc_core import ServiceConfig
    from trainguard.errors import ConfigError

    posters: list[Any] = []
    if args.jsonl:
        posters.append(JsonlPoster(args.jsonl))
    if args.webhook:
        posters.append(WebhookPoster(args.webhook))
    if args.slack_webhook:
        posters.append(SlackPoster(args.slack_webhook))
    try:
        cfg = ServiceConfig(allowed_roots=args.allowed_root, api_keys=_keys(args),
                            db_url=args.db, max_body_bytes=args.max_body,
                            rate_per_minute=args.rate_limit, workers=args.workers,
                            posters=posters, policy=RestartPolicy())
    except (ConfigError, OSError) as exc:
        print(f"trainguard attrsvc: error: {exc}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning")
    return 0

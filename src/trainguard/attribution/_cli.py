"""``trainguard analyze`` and ``trainguard attrsvc`` sub-commands."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["register"]

_EXIT_BAD_INPUT = 2
_EXIT_OUTPUT = 74  # EX_IOERR: the result could not be written


def register(subparsers) -> list[str]:
    """Add ``analyze`` and ``attrsvc`` to the ``trainguard`` command line."""
    p = subparsers.add_parser("analyze", help="attribute a failed run from its logs and/or "
                              "flight-recorder dumps")
    p.add_argument("logs", nargs="*", metavar="LOG", help="log files of one attempt")
    p.add_argument("--fr-dir", help="flight-recorder dumps (directory or file prefix)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--history", help="earlier cycles' `analyze --json` outputs (JSON list or "
                   "JSON lines), oldest first")
    reg = p.add_mutually_exclusive_group()
    reg.add_argument("--registry", metavar="YAML",
                     help="site pattern registry merged on top of the shipped one: rows with a "
                     "shipped id override it, new ids are added, categories/exit_codes entries "
                     "override by name")
    reg.add_argument("--registry-replace", metavar="YAML",
                     help="pattern registry used INSTEAD of the shipped one (must declare every "
                     "category)")
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
    s.add_argument("--port", type=int, default=8000,
                   help="TCP port (default %(default)s; 0 picks a free one, printed at startup)")
    s.add_argument("--allowed-root", action="append", required=True,
                   help="directory whose logs may be analysed (repeatable)")
    s.add_argument("--api-key-file", help="file with one API key per line (or set "
                   "TRAINGUARD_ATTRSVC_API_KEYS=key1,key2)")
    s.add_argument("--allow-anonymous", action="store_true",
                   help="serve without API keys; only with a loopback --host (127.0.0.1, ::1, "
                   "localhost)")
    s.add_argument("--nvrx-trust-loopback", action="store_true",
                   help="accept NVRx launcher calls (POST/GET /logs, which carry no API key) "
                   "from 127.0.0.1/::1 without a key; remote NVRx clients use the endpoint "
                   "http://HOST:PORT/k/<API-KEY>")
    s.add_argument("--db", help="sqlite:///PATH result store (default sqlite:///"
                   "$XDG_STATE_HOME/trainguard/attrsvc.db, i.e. ~/.local/state/trainguard/"
                   "attrsvc.db when XDG_STATE_HOME is unset; printed at startup)")
    s.add_argument("--rate-limit", type=int, default=600,
                   help="requests/minute per client (default %(default)s)")
    s.add_argument("--max-body", type=int, default=64 * 1024,
                   help="max request body in bytes (default %(default)s)")
    s.add_argument("--workers", type=int, default=2,
                   help="concurrent analyses (default %(default)s)")
    s.add_argument("--jsonl", help="append every result to this JSON-lines file")
    s.add_argument("--webhook", help="POST every result to this URL (3 tries with backoff)")
    s.add_argument("--slack-webhook", help="Slack incoming-webhook URL (STOP verdicts only)")
    s.set_defaults(func=_attrsvc)
    return ["analyze", "attrsvc"]


def _run_analysis(args) -> dict[str, Any]:
    from trainguard.attribution._agent import RestartPolicy, load_history
    from trainguard.attribution._pipeline import analyze

    if not args.logs and not args.fr_dir:
        raise ValueError("give at least one LOG file or --fr-dir")
    history = load_history(args.history) if args.history else []
    out = analyze(args.logs, fr_dir=args.fr_dir, history=history,
                  policy=RestartPolicy(same_root_limit=args.same_root_limit),
                  registry_path=args.registry_replace or args.registry,
                  replace_registry=bool(args.registry_replace), job_ended=args.ended)
    if args.logs and args.llm_url:
        from trainguard.attribution._llm import LlmExplainer

        out["llm"] = LlmExplainer(args.llm_url, args.llm_model,
                                  os.environ.get("TRAINGUARD_LLM_API_KEY")).explain(out)
    return out


def _analyze(args) -> int:
    from trainguard.errors import TrainguardError

    try:
        out = _run_analysis(args)
    except (TrainguardError, ValueError) as exc:
        print(f"trainguard analyze: error: {exc}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    try:
        if args.json:
            sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
        else:
            _print_report(out)
        sys.stdout.flush()
    except OSError as exc:  # a full disk, a closed pipe: one line, not a traceback
        _silence_stdout()
        print(f"trainguard analyze: error: cannot write the result to standard output: "
              f"{exc.strerror or exc}; write it to a device with free space", file=sys.stderr)
        return _EXIT_OUTPUT
    return 0


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _print_report(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(highlight=False)
    for warning in out.get("warnings", ()):
        con.print(f"[bold yellow]Warning:[/bold yellow] {escape(warning)}")
    if "evidence" in out:  # a log analysis
        con.print(f"[bold]Root cause:[/bold] {out['primary_category']} "
                  f"([italic]{out['failure_domain']}[/italic]), confidence {out['confidence']}")
        hosts = out.get("culprit_hosts")
        if out["culprit_ranks"] or out["culprit_nodes"] or hosts:
            nodes = _listed(out["culprit_nodes"]) if out["culprit_nodes"] else \
                f"{_listed(hosts)} (where it ran; not at fault)" if hosts else "unknown"
            con.print(f"  ranks: {_listed(out['culprit_ranks'])}  nodes: {escape(nodes)}")
        if out["evidence"]:
            table = Table("file:line", "role", "text", show_lines=False)
            for ev in out["evidence"]:
                table.add_row(escape(f"{os.path.basename(ev['file'])}:{ev['line']}"),
                              ev["role"], escape(ev["text"][:160]))
            con.print(table)
        for c in out["cascades"]:
            con.print(f"  cascade: {c['category']} x{c['count']} on ranks {c['ranks']}")
        for ex in out.get("failed_exits", ())[:4]:
            con.print(f"  exit: {escape(_exit_words(ex))}")
        for rec in out.get("recovered", ())[:4]:
            con.print(f"  recovered in-process: {escape(_recovered_words(rec))}")
        con.print(f"  progress: {_progress_words(out['progress'])}")
    fr = out.get("flight_recorder")
    if fr:
        stuck = fr["first_stuck"] or {}
        first = (f"{_word(stuck.get('op'))} seq {_word(stuck.get('collective_seq_id'))} in "
                 f"{_word(stuck.get('pg_desc'))} (pg {_word(stuck.get('pg_name'))})"
                 if stuck else "none")
        con.print(f"[bold]Flight recorder:[/bold] faulty ranks {_listed(fr['faulty_ranks'])} "
                  f"(never joined {_listed(fr['missing_ranks'])}, joined but not completed "
                  f"{_listed(fr['incomplete_ranks'])}); first stuck: {escape(first)}; "
                  f"{len(fr['mismatches'])} mismatch(es)")
    con.print(f"[bold]Decision:[/bold] {out['decision'] or 'none'} - {escape(out['reason'])}")


def _word(value: Any) -> str:
    """A value for a sentence: ``unknown`` in words, never a bare ``None``."""
    return "unknown" if value is None else str(value)


def _listed(values: Any) -> str:
    """A list as ``[1, 3]``; ``unknown`` in words for ``None`` (never a bare ``None``)."""
    return "unknown" if values is None else str(list(values))


def _progress_words(prog: dict[str, Any]) -> str:
    step = prog.get("last_step")
    text = f"last step {step}" if step is not None else "no training step logged"
    if prog.get("checkpoint_saved"):
        ck = prog.get("last_checkpoint_step")
        return text + (f", checkpoint saved at step {ck}" if ck is not None
                       else ", a checkpoint was saved (step not logged)")
    return text + ", no checkpoint save in the log"


def _exit_words(ex: dict[str, Any]) -> str:
    """``rank 1 killed by SIGKILL (exit -9) from outside the launcher on vm``."""
    who = f"rank {ex['rank']}" if ex.get("rank") is not None else \
        f"local rank {ex['local_rank']}" if ex.get("local_rank") is not None else \
        "a process (rank not named)"
    what = f"killed by {ex['signal']} (exit code {ex['code']})" if ex.get("signal") \
        else f"exited with code {ex['code']}"
    sender = {"outside": " from outside the launcher", "launcher": " by the launcher"}.get(
        ex.get("sender") or "", "")
    node = f" on {ex['node']}" if ex.get("node") else ""
    return f"{who} {what}{sender}{node}"


def _recovered_words(rec: dict[str, Any]) -> str:
    what = rec.get("category") or rec.get("cause") or "a fault"
    ranks = f" on rank(s) {_listed(rec['ranks'])}" if rec.get("ranks") else ""
    it = rec.get("iteration")
    step = f" (restart {it} -> {it + 1})" if it is not None else ""
    return f"{what}{ranks}{step} at {os.path.basename(rec['file'])}:{rec['line']}"


def _keys(args) -> list[str]:
    keys = [k for k in os.environ.get("TRAINGUARD_ATTRSVC_API_KEYS", "").split(",") if k.strip()]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as fh:
            keys += [line.strip() for line in fh if line.strip()]
    return keys


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _service_config(args):
    """ServiceConfig from the flags. Raises ConfigError/OSError on bad settings."""
    from trainguard.attribution._agent import RestartPolicy
    from trainguard.attribution._posting import JsonlPoster, SlackPoster, WebhookPoster
    from trainguard.attribution._svc_core import ServiceConfig, default_db_url
    from trainguard.errors import ConfigError

    if args.allow_anonymous and not _is_loopback(args.host):
        raise ConfigError(f"--allow-anonymous needs a loopback --host (127.0.0.1, ::1 or "
                          f"localhost), got {args.host!r}; use --api-key-file instead")
    posters: list[Any] = []
    if args.jsonl:
        posters.append(JsonlPoster(args.jsonl))
    if args.webhook:
        posters.append(WebhookPoster(args.webhook))
    if args.slack_webhook:
        posters.append(SlackPoster(args.slack_webhook))
    return ServiceConfig(allowed_roots=args.allowed_root, api_keys=_keys(args),
                         db_url=args.db or default_db_url(), max_body_bytes=args.max_body,
                         rate_per_minute=args.rate_limit, workers=args.workers,
                         posters=posters, policy=RestartPolicy(),
                         allow_anonymous=args.allow_anonymous,
                         nvrx_trust_loopback=args.nvrx_trust_loopback)


def _bind(host: str, port: int):
    """A listening TCP socket, so the printed address is the real one (``--port 0`` included)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on, while the app starts
    except OSError:
        sock.close()
        raise
    return sock


def _check_db(url: str) -> None:
    """Open (and create) the result store once, before anything is announced.

    Raises:
        ConfigError: the URL is not SQLite, the file is not an SQLite database, or the location
            cannot be created or written (the message names the path and the fix).
    """
    import sqlite3

    from trainguard.attribution._store import ResultStore, db_path_from_url
    from trainguard.errors import ConfigError

    path = os.path.abspath(db_path_from_url(url)) if db_path_from_url(url) != ":memory:" else url
    try:
        ResultStore(url).close()
    except (sqlite3.Error, OSError) as exc:
        raise ConfigError(
            f"--db {path}: cannot use it as the result store ({exc}); point --db at a writable "
            "location, e.g. --db sqlite:///$HOME/attrsvc.db (a new file is created)"
        ) from exc


def _attrsvc(args) -> int:
    import uvicorn

    from trainguard.attribution._service import create_app
    from trainguard.attribution._store import db_path_from_url
    from trainguard.errors import ConfigError

    try:
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port {args.port} is not a TCP port: use 1-65535 (or 0 to pick "
                              "a free one)")
        cfg = _service_config(args)
        _check_db(cfg.db_url)
        sock = _bind(args.host, args.port)
    except (ConfigError, OSError) as exc:
        print(f"trainguard attrsvc: error: {exc}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    auth = f"{len(cfg.api_keys)} API key(s)" if cfg.api_keys else "ANONYMOUS (no API key)"
    for line in (f"listening on http://{shown}:{port}",
                 f"database: {os.path.abspath(db_path_from_url(cfg.db_url))}",
                 f"allowed roots: {', '.join(cfg.allowed_roots)}",
                 (f"auth: {auth}; rate limit {cfg.rate_per_minute}/min per client; "
                  f"{cfg.workers} worker(s)")):
        print(f"trainguard attrsvc: {line}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0

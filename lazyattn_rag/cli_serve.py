"""``lazyattn serve``: the OpenAI-compatible HTTP API on Ray Serve (issue 18; needs the ``serve`` extra)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

from lazyattn_rag import cli_options as cli_opts


def _config_defaults(ctx: typer.Context, param, value: Optional[Path]) -> Optional[Path]:
    """``--config FILE.yaml``: its keys (the flags' names, with or without ``--``, dashes or
    underscores) become the defaults of the other flags, so flags given on the command line win.
    Raises ``typer.BadParameter`` naming an unknown key or a file that is not a mapping."""
    if value is None or ctx.resilient_parsing:
        return value
    import yaml

    data = yaml.safe_load(value.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value} must hold a mapping of flag names to values")
    names = {p.name for p in ctx.command.params} - {"config_file", "model_path"}
    defaults = {}
    for key, item in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in names:
            raise typer.BadParameter(f"{value}: unknown key {key!r} (the keys are the flags' names)")
        defaults[name] = item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _listed(values: list[str]) -> tuple[str, ...]:
    """Repeated flag values, each a value or a JSON list of them (vLLM's form: '["*"]')."""
    out: list[str] = []
    for value in values:
        if value.strip().startswith("["):
            parsed = json.loads(value)
            if not isinstance(parsed, list):
                raise ValueError(f"{value!r} is not a JSON list")
            out += [str(v) for v in parsed]
        else:
            out.append(value)
    return tuple(out)


@cli_opts.with_engine_options(after=("learn_passages", "enable_prefix_caching", "registry", "ingress_replicas",
                                     "max_logprobs", "health_timeout_s", "switch_interval_ms", "api_key", "api_key_file",
                                     "allow_unauthenticated", "ray_address"))
def serve(
    model_path: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                               help="As --model (vLLM's positional MODEL)."),
    config_file: Optional[Path] = typer.Option(None, "--config", exists=True, dir_okay=False, is_eager=True,
                                               callback=_config_defaults, metavar="FILE.yaml",
                                               help="Flag values from a YAML mapping (keys: the flags' names, "
                                                    "e.g. max-model-len: 4096); flags given too win."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="The model's name in the API (default: the model's)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", min=2,
                                                help="Context length (default: the model's)."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on CUDA, float32 on a CPU), float32, bfloat16 or "
                                           "float16."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, "--gpu-memory-utilization", help="The share of free GPU memory the KV cache takes, in (0, 1) (after "
                                               "the weights are loaded; vLLM's counts them in)."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", min=1, help="Most requests in one step."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens", min=1,
                                                         help="Most tokens computed in one step."),
    log_level: str = typer.Option("warning", "--log-level", help="The replicas' log level: debug, info, warning "
                                                                 "or error (info: an access-log line per request)."),
    allowed_origins: list[str] = typer.Option([], "--allowed-origins", metavar="ORIGIN",
                                              help="An origin browsers may call the API from (repeatable, or a JSON "
                                                   "list; \"*\": any). Default: none (no CORS headers)."),
    allowed_methods: list[str] = typer.Option([], "--allowed-methods", metavar="METHOD",
                                              help="Methods such a call may use (default: any)."),
    allowed_headers: list[str] = typer.Option([], "--allowed-headers", metavar="HEADER",
                                              help="Headers such a call may send (default: any)."),
    replicas: int = typer.Option(1, min=1, help="Engine replicas, each with its own engine and KV cache "
                                                "(one GPU each with --gpus-per-replica 1)."),
    gpus_per_replica: Optional[float] = typer.Option(None, "--gpus-per-replica", min=0,
                                                     help="GPUs each replica reserves (default: 1 when the "
                                                          "device is CUDA, else 0)."),
    router: str = typer.Option("affinity", help="affinity (a request goes to the replica owning most of its "
                                                "documents) or default (Ray Serve's power of two choices)."),
    imbalanced_threshold: int = typer.Option(8, min=0, help="The affinity router sends a request elsewhere when "
                                                            "its owner's queue is longer than the shortest by more."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, help="HTTP port."),
    learn_passages: bool = typer.Option(True, "--learn-passages/--no-learn-passages",
                                        help="Serve passages that recur in plain prompts (retrieved texts an "
                                             "unchanged OpenAI client pastes into its messages) from cached chunks "
                                             "at any offset."),
    enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                               help="Reuse exact prompt prefixes (system prompts, earlier chat "
                                                    "turns, repeats), as vLLM does."),
    registry: str = typer.Option("auto", metavar="WHERE",
                                 help="Where registered documents persist: auto (the --redis-url server, else a "
                                      "SQLite file under the cache dir), a redis:// URL, a file path, or memory."),
    ingress_replicas: int = typer.Option(1, min=1, help="HTTP ingress replicas (they share the registry)."),
    max_logprobs: int = typer.Option(20, min=-1, help="The most top_logprobs a request may ask for (-1: the whole "
                                                      "vocabulary)."),
    health_timeout_s: float = typer.Option(5.0, "--health-timeout-s", min=0.01, max=3600,
                                           help="How long GET /health waits for an engine replica before it "
                                                "answers 503 (keep it under the probe's own timeout)."),
    switch_interval_ms: float = typer.Option(0.5, "--switch-interval-ms", min=0.01, max=100,
                                             help="Python's thread switch interval in each engine replica (ms): "
                                                  "how long a thread handing over a request or a token may wait "
                                                  "for the GIL (Python's default: 5)."),
    api_key: list[str] = typer.Option([], "--api-key", metavar="KEY", envvar="LAZYATTN_API_KEY", show_envvar=True,
                                      help="A key requests must carry (Authorization: Bearer KEY), allowed every "
                                           "namespace; repeat for several (the variable: separated by spaces)."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", exists=True, dir_okay=False,
                                                help="JSON file binding keys to namespaces: {\"keys\": [{\"key\", "
                                                     "\"namespaces\": [...], \"manage_documents\": bool}]} (README, "
                                                     "'Keys, tenants and deletes')."),
    allow_unauthenticated: bool = typer.Option(False, "--allow-unauthenticated",
                                               help="Without keys, serve clients beyond loopback too (needed to "
                                                    "listen on another --host without keys)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                              help="Run on this Ray cluster (auto, host:port; several nodes: protect "
                                                   "its ports, see the README). Default: a private local cluster "
                                                   "listening on 127.0.0.1 only, without a dashboard."),
    engine: cli_opts.EngineOptions = cli_opts.EngineOptions(),
) -> None:
    """Serve the model over HTTP: OpenAI chat completions and completions with document ids, on Ray Serve replicas.

    POST /v1/documents registers documents; POST /v1/chat/completions answers, placing the documents whose ids its "documents" field lists, or, for a plain prompt, those whose registered text it contains; passages that recur in plain prompts are learned and exact prefixes cached; GET /metrics is Prometheus.

    The engine options are lazyattn chat's; with --redis-url the replicas share computed chunks and the registry.
    """
    import pydantic

    from lazyattn_rag.serve.builder import ServeArgs

    try:
        if model_path is not None and engine.model not in (None, model_path):
            raise ValueError(f"MODEL {model_path!r} and --model {engine.model!r} differ: give one")
        engine = dataclasses.replace(engine, model=model_path or engine.model)
        args = ServeArgs(
            model=engine.model, device=engine.device, served_model_name=served_model_name, dtype=dtype,
            max_model_len=max_model_len, kv_cache_dtype=engine.kv_cache_dtype, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, learn_passages=learn_passages,
            enable_prefix_caching=enable_prefix_caching, replicas=replicas, gpus_per_replica=gpus_per_replica,
            recompute_chunk_head_tokens=engine.recompute_chunk_head_tokens,
            router=router, imbalanced_threshold=imbalanced_threshold, registry=registry,
            ingress_replicas=ingress_replicas, max_logprobs=max_logprobs, health_timeout_s=health_timeout_s,
            switch_interval_ms=switch_interval_ms, api_key=list(api_key),
            api_key_file=None if api_key_file is None else str(api_key_file),
            allow_unauthenticated=allow_unauthenticated, log_level=log_level,
            allowed_origins=list(_listed(allowed_origins)), allowed_methods=list(_listed(allowed_methods) or ("*",)),
            allowed_headers=list(_listed(allowed_headers) or ("*",)))
        engine_config = args.engine_config(engine.config())
        config = args.serve_config(host=host, port=port, ray_address=ray_address)
        from lazyattn_rag.serve.auth import load_grants

        load_grants(config.api_keys, config.api_key_file)  # a bad key file is named now, before Ray starts
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        typer.echo(f"error: --{str(first['loc'][0]).replace('_', '-')}: {first['msg']}", err=True)
        raise typer.Exit(2) from e
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    try:
        from lazyattn_rag.serve.app import run
    except ModuleNotFoundError as e:
        typer.echo(f"error: lazyattn serve needs Ray Serve ({e.name} is missing): pip install 'lazyattn-rag[serve]'",
                   err=True)
        raise typer.Exit(2) from e
    where = (f"on the Ray cluster at {ray_address}" if ray_address is not None else
             "on a private local Ray cluster (127.0.0.1 only, token authentication, no dashboard UI)")
    keys = "API keys required" if config.authenticates else "no API key: loopback clients only"
    if config.allow_unauthenticated and not config.authenticates:
        keys = "no API key: anyone who can reach it"
    typer.echo(f"starting {replicas} replica{'s' if replicas != 1 else ''} ({router} routing) {where}, and the HTTP "
               f"API on http://{host}:{port} ({keys}) ...", err=True)
    try:
        run(engine_config, config, ready=lambda: typer.echo(f"ready: http://{host}:{port} (Ctrl-C stops)", err=True))
    except KeyboardInterrupt:
        typer.echo("stopped", err=True)

"""``knapray serve``: a trained run behind HTTP, on Ray Serve (embedded local Ray).

    knapray serve --run runs/NAME --world-size 4
    curl -X POST localhost:8000/v1/generate -d '{"caption": "a red bicycle", "size": "512x512"}' -o out.png

Each request's jobs go at once to a gang of ``--world-size`` workers that hold the model once
and run requests continuously on blocks of ranks (knapray/driver/serving.py has the routes and
answers; docs/serving.md the routes, limits, cancelling, keys and metrics). Every flag and the run
(its config, checkpoint and corpus record) are checked before Ray starts; the embedded Ray
listens on 127.0.0.1 only (``knapray.local_ray``), the HTTP server on ``--host``. It serves
until Ctrl-C. ``--config-out FILE`` writes a Serve config for ``serve deploy`` on a cluster
instead (the run path as given: where the cluster's nodes read it; ``--host`` as given).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time

from knapray.limits import MAX_IMAGE_SIDE, MAX_IMAGE_TOKENS, MAX_SAMPLE_REQUESTS

MAX_QUEUE = 1 << 16
MAX_SERVE_STEPS = 10_000
MAX_REQUEST_TIMEOUT_S = 86_400
API_KEY_ENV = "KNAPRAY_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_device, add_removed, add_world_size, int_at_least

    p.add_argument("--run", required=True, help="run directory (runs/NAME)")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    add_world_size(p, default=1, help="workers of the gang that holds the model once (default 1)")
    p.add_argument("--topology", default=None,
                   help="the gang's blocks: a topology whose bags they are, e.g. g2n1+g1n2; default auto: every "
                   "aligned power-of-two block of a node (and of whole nodes) whose size divides the heads, the gang's "
                   "scheduler choosing per request")
    add_device(p, help="where the gang runs (auto: cuda when Ray has GPUs)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    p.add_argument("--port", type=int_at_least(1, 65535), default=8000, help="HTTP port (default 8000)")
    p.add_argument("--max-queue", type=int_at_least(1, MAX_QUEUE), default=256,
                   help="jobs submitted to the gang and not yet answered (waiting or running), at most; more are "
                   "answered 503 (default 256)")
    p.add_argument("--max-steps", type=int_at_least(1, MAX_SERVE_STEPS), default=100,
                   help="Euler steps a request may ask for, at most (default 100; more is answered 400)")
    p.add_argument("--max-request-side", type=int_at_least(1, MAX_IMAGE_SIDE), default=None,
                   help="pixels a side a request may ask for, at most (default: the run's, the largest square of "
                   f"{MAX_IMAGE_TOKENS} image tokens, e.g. 4096 at VAE 8 and 2x2 patches)")
    p.add_argument("--max-request-frames", type=int_at_least(1, MAX_IMAGE_TOKENS), default=None,
                   help="latent frames a request may ask for, at most (default: the run's: 1 for an image family)")
    p.add_argument("--max-n", type=int_at_least(1, MAX_SAMPLE_REQUESTS), default=4,
                   help="images one /v1/images/generations request may ask for (n), at most (default 4)")
    p.add_argument("--request-timeout", type=seconds_in(MAX_REQUEST_TIMEOUT_S), default=300.0, metavar="SECONDS",
                   help="a request not answered this long after it arrived is answered 504 and cancelled: dropped if "
                   "still queued, stopped between two steps if running (default 300)")
    p.add_argument("--api-key", default=None,
                   help=f"a bearer token every route but /health requires (default: ${API_KEY_ENV}, else none; "
                   "prefer the variable: a flag is seen by this machine's other users in ps)")
    p.add_argument("--adapter", action="append", metavar="NAME=RUN", default=None,
                   help="serve LoRA run RUN (of --run's base) as model NAME beside --run's own (repeat for several; "
                   "POST /v1/adapters adds one while serving)")
    add_removed(p, "--lora", "serve takes --adapter NAME=RUN (export's --lora is a switch: a flag keeps one meaning)")
    p.add_argument("--config-out", metavar="FILE",
                   help="write a Serve config for `serve deploy` on a cluster and exit (nothing starts)")


def seconds_in(most: int):
    """A flag type: seconds in (0, ``most``]."""

    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 40 else float("nan")
        except ValueError:
            value = float("nan")
        if not 0 < value <= most:  # NaN too
            raise argparse.ArgumentTypeError(f"expected seconds in (0, {most}], got {text[:40]!r}")
        return value

    parse.__name__ = f"seconds(0,{most}]"
    return parse


def serve_options(args: argparse.Namespace):
    """The ``ServeOptions`` of the flags; ValueError naming the first bad one."""
    from knapray.planning import Topology

    try:
        from knapray.driver.serving import ServeOptions, check_api_key
    except ImportError as e:  # ray[serve], PyAV: the serve extra
        raise ValueError(f"knapray serve needs the serve extra: pip install -e '.[serve]' ({e})") from None

    if args.topology not in (None, "auto"):  # auto: the gang's aligned blocks (gang_blocks)
        try:
            Topology.parse(args.topology, args.world_size)
        except ValueError as e:
            raise ValueError(f"--topology {args.topology}: {e}") from None
    # --api-key, else $KNAPRAY_API_KEY, else none; a bad one named by where it came from, never shown
    key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if key is not None:
        check_api_key(key, "--api-key" if args.api_key is not None else f"${API_KEY_ENV}")
    if args.max_n > args.max_queue:
        raise ValueError(f"--max-n {args.max_n}: more than --max-queue {args.max_queue}; a request of n images "
                         "queues n jobs")
    adapters = {}
    for item in args.adapter or ():
        name, sep, run = item.partition("=")
        if not sep or not name or not run:
            raise ValueError(f"--adapter {item[:60]}: NAME=RUN, a model name and a LoRA run directory")
        if name in adapters:
            raise ValueError(f"--adapter {name}: given twice")
        adapters[name] = run
    return ServeOptions(run=args.run, world_size=args.world_size, topology=args.topology, device=args.device,
                        checkpoint=args.checkpoint, max_queue=args.max_queue, max_steps=args.max_steps,
                        max_side=args.max_request_side, max_frames=args.max_request_frames, max_n=args.max_n,
                        request_timeout_s=args.request_timeout, api_key=key, adapters=adapters or None)


def check_run(run_dir: str, checkpoint: str | None, world_size: int = 1, topology: str | None = None,
              options=None) -> str:
    """What ``knapray sample`` checks before loading weights: the run's config, its
    checkpoint, the corpus record, that the model's heads split over every bag the gang
    may use, and that ``options``' limits leave the run a size. Returns the checkpoint's path."""
    from knapray.distributed.groups import check_heads
    from knapray.driver.run_dir import read_run_config, run_checkpoint
    from knapray.inference.jobs import run_rules
    from knapray.planning import Topology
    from knapray.driver.gang import gang_blocks
    from knapray.worker.checkpoint import check_checkpoint

    cfg = read_run_config(run_dir)
    path = run_checkpoint(run_dir, checkpoint, "serve")
    rules = run_rules(cfg)
    if options is not None:
        from knapray.driver.serving import ServeLimits

        try:
            ServeLimits.of(options, rules, cfg.model.family)
        except ValueError as e:
            raise ValueError(str(e).replace("max_side: ", "--max-request-side ", 1)) from None
    heads = cfg.model.num_heads
    try:
        specs = gang_blocks(topology, world_size, heads)[1]
    except ValueError as e:
        raise ValueError(f"--topology {topology}: {e}") from None
    for spec in specs:
        try:
            check_heads(heads, Topology.parse(spec, world_size=world_size))
        except ValueError as e:
            raise ValueError(f"--topology {spec}: {e}") from None
    check_checkpoint(path)
    if options is not None and options.adapters:
        from knapray.driver.trained import check_adapter

        for name, run in options.adapters.items():  # a LoRA run of this run's base, read without weights
            try:
                check_adapter((cfg, path), name, run)
            except ValueError as e:
                raise ValueError(f"--adapter {name}={run}: {str(e).split(': ', 1)[-1]}") from None
    return path


def check_port(host: str, port: int) -> None:
    """``host:port`` can be listened on now, as Serve's HTTP server listens (``SO_REUSEADDR``):
    a port a server listens on is refused, one whose last connections linger in TIME_WAIT
    after a server on it stopped is not (without it, ``knapray serve`` run again right after
    one was stopped refused its port for a minute)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None


def listening(host: str) -> str:
    """Who can reach a server on ``host``, in words."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return f"{host} only: this machine's clients alone (--host 0.0.0.0 for every interface)"
    if host in ("0.0.0.0", "::"):
        return f"{host}: every interface, open to the network (give --api-key)"
    return f"{host} only"


def write_config(path: str, options, host: str, port: int) -> None:
    import yaml

    from knapray.driver.serving import serve_config

    with open(path, "w") as f:
        f.write(f"# knapray serve on a Ray cluster: serve deploy {path}\n# listens on {listening(host)}\n")
        if options.api_key is not None:
            f.write(f"# requires an API key, not written here: set {API_KEY_ENV} in the replica's environment\n")
        yaml.safe_dump(serve_config(options, host=host, port=port), f, sort_keys=False)


def check_cluster_gpus(ray, options) -> None:
    """On a cluster joined through ``$RAY_ADDRESS``: a gang on GPUs (``--device cuda``, or
    ``auto`` where the cluster has any) whose ranks, a GPU each, never fit the cluster's nodes
    and those its autoscaler reported it may add would wait for good: one line (ValueError).
    A cluster that reports no node types may still add some: its wait is not refused."""
    from knapray.driver.placement import cluster_capacity, room_for
    from knapray.local_ray import address_given

    if address_given() is None:
        return  # the embedded Ray: checked before it started
    capacity = cluster_capacity(ray, "the Ray cluster at $RAY_ADDRESS")
    if options.device == "cpu" or (options.device == "auto" and not capacity.total().get("GPU", 0.0)):
        return
    room = room_for({"GPU": 1.0, "CPU": 1.0}, capacity)  # what each of the gang's actors asks on GPUs
    if room < options.world_size:
        raise ValueError(f"--world-size {options.world_size}: each rank of the gang takes a GPU and a CPU, and "
                         f"{capacity.where} holds {room} such ranks at once, with every node its autoscaler may add; "
                         f"--world-size {room} or fewer, or --device cpu")


def cli(args: argparse.Namespace) -> int:
    """``knapray serve``."""
    from knapray.commands.flags import check_local_processes

    options = serve_options(args)
    if args.config_out:
        write_config(args.config_out, options, args.host, args.port)
        key = f"; it requires {API_KEY_ENV} in the replica's environment" if options.api_key is not None else ""
        print(f"wrote {args.config_out}: serve deploy {args.config_out} (ray[serve] on every node; the run at "
              f"{args.run} readable there{key}); it listens on {listening(args.host)}")
        return 0
    check_local_processes(args.world_size, "knapray serve (embedded Ray)")
    from knapray.local_ray import address_given

    if address_given() is None:  # an embedded Ray has this machine's GPUs, and nothing adds more
        from dataclasses import replace

        from knapray.commands.flags import gang_device
        from knapray.driver.placement import EMBEDDED, local_gpus

        options = replace(options, device=gang_device(args.device, args.world_size, local_gpus(), EMBEDDED))
    checkpoint = check_run(args.run, args.checkpoint, args.world_size, args.topology, options)
    check_port(args.host, args.port)

    import ray
    from ray import serve

    from knapray.driver.serving import build_app
    from knapray.local_ray import SETTLE_S, gone_within, init_ray, logs_dir, started_here
    from knapray.stopping import exit_at_once, exit_code, signal_name, stop_on_signals

    stopped = None
    with stop_on_signals() as signals:  # SIGTERM (a scheduler, a container's stop) as Ctrl-C
        try:
            # Ray's and Serve's own lines (its start, the proxy's and the controller's, each
            # request's access line) stay in the session's logs, as for knapray train: the
            # console shows knapray's lines, and the gang's errors reach the clients.
            init_ray(ray, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
            signals.arm()  # in case ray.init put its own SIGTERM handler in place (init_ray keeps it out)
            check_cluster_gpus(ray, options)
            logging.getLogger("ray.serve").setLevel(logging.ERROR)
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run(build_app(options), name="knapray", route_prefix="/")
            host = "localhost" if args.host in ("127.0.0.1", "0.0.0.0") else args.host
            print(f"serving {args.run} ({checkpoint}, {args.world_size} workers) at http://{host}:{args.port}"
                  f"/v1/generate (listening on {listening(args.host)}{'; API key required' if options.api_key else ''}"
                  f"; Ctrl-C stops); Ray's, Serve's and the gang's logs: {logs_dir()}", flush=True)
            while True:
                time.sleep(1)
        except KeyboardInterrupt as e:
            signals.taken()  # stopping: Ray's shutdown below is not to be interrupted again
            stopped = e
        finally:
            # A SIGTERM to every process of the command's tree (a Slurm step's) stops its
            # embedded Ray's servers too: Ray's shutdown then waited 7-8 s on them, and its exit
            # hook would again. A terminal's Ctrl-C reaches the command alone (Ray's processes
            # run in a session of their own): no wait for that.
            gone = started_here(ray) and stopped is not None and signal_name(stopped, signals) == "SIGTERM" \
                and gone_within(ray, SETTLE_S)
            if ray.is_initialized() and not gone:
                # An embedded Ray goes with everything in it; Serve's graceful shutdown would only
                # print its replicas' removal and a retried task of its killed controller.
                if not started_here(ray):
                    serve.shutdown()
                ray.shutdown()
        print(f"\nknapray serve: stopped ({signal_name(stopped, signals)})", flush=True)
        if gone:
            exit_at_once(exit_code(stopped, signals))
        return exit_code(stopped, signals)


def main(argv: list[str] | None = None) -> int:
    from knapray.commands.flags import Parser

    p = Parser(prog="knapray serve", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""tools/plan_layout.py's command line: pretrain_bloom.py's flags and DeepSpeed JSON plus the hardware, a table of
every valid layout with predicted memory and speed, and a recommendation.

    python tools/plan_layout.py --num-gpus 4 --gpu-memory-gib 24 --gpu rtx3090 <pretrain_bloom.py flags>
"""
import dataclasses
import json
import sys

from megatron.planning import memory, planner, speed

_FILLERS = (("--lr", "1e-4"), ("--train-iters", "1"))  # required by pretrain_bloom.py, irrelevant to a plan


def build_parser():
    from megatron.arguments import ArgumentParser  # raises ConfigError with one line; main() prints it once
    p = ArgumentParser(
        description="Which TP x PP x DP x ZeRO x micro batch layout fits these GPUs, and which is fastest. "
                    "Every other flag is pretrain_bloom.py's (paste the launch line).", allow_abbrev=False)
    g = p.add_argument_group("hardware")
    g.add_argument("--num-gpus", type=int, required=True, help="GPUs of the run (the world size)")
    g.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU (default: the --gpu's)")
    g.add_argument("--gpu", default="rtx3090", help=f"GPU kind for peak FLOP/s and bandwidths: {', '.join(speed.GPUS)}")
    g.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak per GPU (default: the --gpu's)")
    g.add_argument("--efficiency", type=float, default=speed.DEFAULT_EFFICIENCY,
                   help="share of the peak the GEMMs reach (default %(default)s)")
    g.add_argument("--collectives-json", default=None,
                   help="bandwidths measured by tools/check_environment.py --collectives --json FILE")
    g.add_argument("--memory-margin", type=float, default=0.1,
                   help="share of --gpu-memory-gib kept free for the CUDA context and fragmentation")
    g.add_argument("--top", type=int, default=15,
                   help="rows of layouts that fit (0: all); the 3 closest that do not follow")
    g.add_argument("--show-refused", action="store_true", help="list every refused combination's reason")
    g.add_argument("--json", default=None, help="write every plan as JSON here")
    return p


def _launch_line(rest):
    """pretrain_bloom.py's Namespace, its DeepSpeed JSON, the tokenizer's vocabulary size (None: mock) and the
    flag values merged with the JSON (merge_json_flags, run once)."""
    from megatron.arguments import parse_args
    from megatron.deepspeed_config import load_user_config, merge_json_flags
    rest = list(rest)
    for flag, value in _FILLERS:
        if flag not in rest:
            rest += [flag, value]
    if "--data-path" not in rest and "--mock-data" not in rest:
        rest.append("--mock-data")  # the planner reads no data
    args = parse_args(rest)
    user = load_user_config(args.deepspeed_config)
    values, _ = merge_json_flags(args, user, args.deepspeed_config)
    vocab = None
    if values["vocab_file"] or values["merge_file"] or values["tokenizer_name_or_path"]:
        from megatron.tokenizer import build_tokenizer, infer_tokenizer_type
        kind = infer_tokenizer_type(values["tokenizer_type"], values["vocab_file"], values["merge_file"],
                                    values["tokenizer_name_or_path"])
        vocab = build_tokenizer(kind, vocab_file=values["vocab_file"], merge_file=values["merge_file"],
                                tokenizer_name_or_path=values["tokenizer_name_or_path"]).vocab_size
    elif not values["mock_data"]:
        raise ValueError("pass the tokenizer flags of the run (--vocab-file/--merge-file or "
                         "--tokenizer-name-or-path), or --pad-vocab-size-to with --mock-data")
    return args, user, vocab, values


def format_table(plans, hardware, top, closest=3):
    """The `top` fastest layouts that fit (all with top 0), then the `closest` that do not (smallest peak)."""
    head = (f"{'TP':>2} {'PP':>2} {'DP':>2} {'ZeRO':>4} {'micro':>5} {'GAS':>4} {'ckpt':>4} {'offl':>4} "
            f"{'weights':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'buffers':>7} {'peak GiB':>8} {'fits':>4} "
            f"{'step s':>7} {'bubble':>6} {'tokens/s':>9}")
    lines = [head]
    fitting = [p for p in plans if p.fits]
    shown = (fitting[:top] if top else fitting) + [p for p in plans if not p.fits][:closest]
    for plan in shown:
        worst = max(plan.stages, key=lambda s: s.peak)
        st, lay = worst.states, plan.layout
        lines.append(
            f"{lay.tp:2d} {lay.pp:2d} {lay.dp:2d} {lay.zero_stage:4d} {lay.micro_batch:5d} "
            f"{plan.config.training.gradient_accumulation_steps:4d} {'yes' if lay.checkpoint_activations else 'no':>4} "
            f"{'yes' if lay.cpu_offload else 'no':>4} {st.weights / memory.GIB:7.2f} {st.gradients / memory.GIB:6.2f} "
            f"{st.optimizer / memory.GIB:6.2f} {worst.activations / memory.GIB:6.2f} "
            f"{(st.comm_buffers + worst.transient) / memory.GIB:7.2f} {plan.peak / memory.GIB:8.2f} "
            f"{'yes' if plan.fits else 'NO':>4} {plan.time.seconds:7.2f} {100 * plan.time.bubble:5.0f}% "
            f"{plan.time.tokens_per_second:9,.0f}")
    return "\n".join(lines)


def stage_lines(plan):
    """Per pipeline stage of a plan: layers, whether it holds the (tied) embedding, and its peak."""
    return [f"  stage {s.stage}: {s.layers} layers{', word embedding' if s.holds_embedding else ''}"
            f"{' + tied LM head and loss' if s.stage == len(plan.stages) - 1 else ''}: peak {s.peak / memory.GIB:.2f} GiB "
            f"(weights {s.states.weights / memory.GIB:.2f}, gradients {s.states.gradients / memory.GIB:.2f}, "
            f"optimizer {s.states.optimizer / memory.GIB:.2f}, activations {s.activations / memory.GIB:.2f})"
            for s in plan.stages]


def main(argv=None):
    from megatron.initialize import exit_before_distributed, setup_logging
    setup_logging()
    try:  # a bad command line (ours or pretrain_bloom.py's) raises ConfigError: printed once, exit 2
        ours, rest = build_parser().parse_known_args(argv)
        spec = speed.gpu_spec(ours.gpu)
        if ours.num_gpus < 1:
            raise ValueError(f"--num-gpus {ours.num_gpus} must be positive")
        if ours.gpu_memory_gib is not None and ours.gpu_memory_gib <= 0:
            raise ValueError(f"--gpu-memory-gib {ours.gpu_memory_gib:g} must be positive (24 for an RTX 3090)")
        if not 0 < ours.efficiency <= 1:
            raise ValueError(f"--efficiency {ours.efficiency:g} is a share of the peak: pass a value in (0, 1], "
                             "e.g. 0.5")
        if not 0 <= ours.memory_margin < 1:
            raise ValueError(f"--memory-margin {ours.memory_margin:g} must be in [0, 1), e.g. 0.1")
        hardware = planner.Hardware(ours.num_gpus, ours.gpu_memory_gib or spec["memory_gib"],
                                    ours.peak_tflops or spec["tflops"], ours.efficiency,
                                    speed.bandwidths_from(spec, ours.collectives_json), ours.memory_margin)
        args, user, vocab, values = _launch_line(rest)
        own, own_ds = planner.resolve(args, ours.num_gpus, user, None, vocab, cuda_available=True, merged=values)
    except ValueError as err:  # the launch line itself is refused: pretrain_bloom.py's message, once
        exit_before_distributed(str(err), 2)
    own_plan = planner.evaluate(own, hardware, own_ds)
    plans, refused = planner.plan_all(args, user, hardware, own.training.global_batch_size, vocab)
    model = own.model
    print(f"model: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
          f"sequence {model.seq_length}, vocabulary {model.vocab_size} (padded at TP 1), "
          f"{model.num_parameters() / 1e9:.2f}B parameters, {own.precision.name}; global batch "
          f"{own.training.global_batch_size}")
    print(f"hardware: {hardware.num_gpus} x {hardware.gpu_memory_gib:g} GiB, {hardware.peak_tflops:g} TFLOP/s peak at "
          f"{hardware.efficiency:.0%}, bandwidths {hardware.bandwidths.source}: all-reduce "
          f"{hardware.bandwidths.all_reduce:g}, p2p {hardware.bandwidths.p2p:g} GB/s; fits = predicted peak <= "
          f"{hardware.usable_bytes / memory.GIB:.1f} GiB ({1 - hardware.memory_margin:.0%})")
    fitting = [p for p in plans if p.fits]
    print(f"{len(plans)} valid layouts, {len(fitting)} fit, {sum(refused.values())} combinations refused by "
          f"pretrain_bloom.py's checks; per GPU (the fullest pipeline stage), GiB:")
    print(format_table(plans, hardware, ours.top))
    if ours.show_refused or not plans:
        for message, count in refused.items():
            print(f"refused ({count}x): {message}")
    print(f"\nyour launch line: {own_plan.layout.short()}: predicted peak {own_plan.peak / memory.GIB:.2f} GiB "
          f"per GPU ({'fits' if own_plan.fits else 'DOES NOT FIT'}), {own_plan.time.tokens_per_second:,.0f} tokens/s")
    print("\n".join(stage_lines(own_plan)))
    sentence = planner.recommendation(plans, hardware, own_plan)
    if fitting:
        print(f"recommended: {fitting[0].layout.short()}:")
        print("\n".join(stage_lines(fitting[0])))
    if ours.json:
        with open(ours.json, "w") as f:
            json.dump([dict(layout=dataclasses.asdict(p.layout), peak_gib=p.peak / memory.GIB,
                            fits=p.fits, step_seconds=p.time.seconds, tokens_per_second=p.time.tokens_per_second,
                            stages_gib=[s.peak / memory.GIB for s in p.stages]) for p in plans], f, indent=1)
    if sentence is None:
        print(f"\nnothing fits in {hardware.gpu_memory_gib:g} GiB: more GPUs, a smaller model or a shorter sequence")
        sys.exit(1)
    print("\n" + sentence)
    pinned = planner.pinned_json_keys(user, fitting[0].layout, own_plan.layout)
    if pinned:
        print(f"(to launch it, drop {', '.join(pinned)} from {args.deepspeed_config} or set them to match: the "
              "flags and the JSON must agree)")
    return plans

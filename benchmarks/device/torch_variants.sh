# Cold torch demo runs of named variants per seed: benchmarks/device/demo_variants.sh with BACKEND=torch, e.g.
#   MODEL=efficientnet_b0 bash benchmarks/device/torch_variants.sh \
#     "amp512=--method amp --batch 512" "amp512cg=--method amp --batch 512 --compile cudagraphs"
BACKEND=torch exec bash "$(dirname "$0")/demo_variants.sh" "$@"

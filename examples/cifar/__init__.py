"""CIFAR-10/100 training demo in PyTorch and JAX/Flax: fp32, amp and triaccel, with plots."""

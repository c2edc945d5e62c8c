"""An exact row split of VAE decoders over several devices, for the Parallel VAE Decode node.

The decoder runs as it is (ComfyUI's own module, one replica per extra device), one band of latent rows per device
and Python thread; its row-reaching modules are swapped for split versions that trade what the band lacks with the
neighbouring bands: convolution halo rows, GroupNorm statistics, attention keys and values (split_modules.py,
exchange.py). The result is the whole-image decode up to float round-off, with each device holding about 1/N of
the activations. Plain torch: this package never imports ComfyUI.
"""

"""`python -m moe`: the main job (a layout demonstration until the MoE runner lands)."""

from layouts import explain, formats

if __name__ == "__main__":
    for spec in (formats.gptq(4), formats.awq(), formats.marlin(4), formats.nvfp4(swizzled=True)):
        print(explain(spec, (64, 128)), end="\n\n")

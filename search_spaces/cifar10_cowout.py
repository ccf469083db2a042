"""CowOut on CIFAR-10 with 1,000 labels: CowMask sigma and kept-proportion ranges, loss weight, EMA, confidence.

Run: python search_spaces/cifar10_cowout.py [--trials N --epochs N --data DIR --preset fast --smoke-test]
The objective is the teacher's error on the 5,000-image holdout carved from the training split, averaged over
the last epochs; the leading trials are confirmed on fresh seeds before anything is promoted.
"""
from trainables.presets import load_config
from trainables.search.driver import HOLDOUT, Confirm, SearchSettings, run_search
from trainables.search.intervals import Float, Interval

# The paper's CowOut setting (Table 1), with a validation holdout instead of the test split.
BASE = load_config("cifar10_cowout", HOLDOUT)

SPACE = {
    "perturb": {
        "sigma_range": Interval(1.0, 32.0, log=True, min_width=1.5),   # paper (4, 16)
        "prop_range": Interval(0.0, 1.0, min_width=0.1),              # fraction kept, paper (0.25, 1)
        "weight": Float(0.1, 10.0, log=True),                         # omega, paper 1
        "conf_thresh": Float(0.5, 0.99),                              # paper 0.97
    },
    "teacher": {"alpha": Float(0.95, 0.999)},                         # paper 0.99
}

# Every trial trains on seed 0; the objective, the first rung and the confirm stage follow what was measured for
# CowMix on WRN-28-2 (search_spaces/cifar10_cowmix.py; docs/search.md, "Noise").
SEARCH = SearchSettings(name="cifar10_cowout", num_samples=64, seed=0, mean_of_last=3, min_rung=0.5,
                        confirm=Confirm(finalists=3, seeds=(1, 2, 3)))

if __name__ == "__main__":
    run_search(BASE, SPACE, SEARCH)

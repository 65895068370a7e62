"""Token sampling that picks exactly what llama-completion picks for the same logits and seed.

The chain mirrors common_sampler_init (common/sampling.cpp) with the defaults of
common_params_sampling (common/common.h):

    [logit-bias] -> penalties -> [dry] -> [top-n-sigma] -> top-k -> [typical] -> top-p -> min-p -> [xtc] -> temp -> dist

The bracketed samplers are no-ops at their defaults; of them only logit-bias is offered. Modules:

* `chain`: SamplingParams and Sampler, the chain one sequence samples with;
* `samplers`: the candidate array and one class per sampler, with llama.cpp's float32 arithmetic;
* `sorting`: llama.cpp's candidate sorts (its 128-bucket partial sort) with libstdc++'s order of ties.

expf, logf, std::sort and std::mt19937 as libllama.so computes them live in orchestrator.cxx. The draw is
std::uniform_real_distribution<double>(0, 1) over std::mt19937.

temp <= 0 is not a separate greedy path in llama.cpp: the temperature sampler keeps only the first
highest logit, and dist still draws (and advances the RNG) before picking it.
Logits must not contain NaN (llama.cpp's comparisons are undefined for them too).
"""

from orchestrator.sampling.chain import LLAMA_DEFAULT_SEED, Sampler, SamplingParams, random_seed
from orchestrator.sampling.samplers import Candidates

__all__ = ["LLAMA_DEFAULT_SEED", "Candidates", "Sampler", "SamplingParams", "random_seed"]

// The tools' CUDA error check: a failed call prints its error and line and ends the program.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x)                                                                \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      printf("CUDA %s at line %d\n", cudaGetErrorString(e_), __LINE__);      \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

// What a CPU kernel extension includes from torch instead of <torch/extension.h>.
//
// <torch/extension.h> brings all of ATen's operators, autograd and the C++ frontend: 22 s of every build on
// 2 cores, before a line of the kernels. The kernels need tensors, at::parallel_for, the few factory
// functions they allocate outputs with, and pybind11 with torch's tensor casters, which compile in about 4 s.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#pragma once
// The entry points of a kernel family, explicitly instantiated for float and double in the
// source that defines them: the kernel table (kernel_table.cpp), compiled in another translation
// unit, takes their addresses. name: the functions' prefix (name##_forward, name##_backward).
#define ATTNLAB_INSTANTIATE_ENTRY_POINTS(name, Problem, Grads)                   \
    template void name##_forward<float>(const Problem<float>&);                  \
    template void name##_forward<double>(const Problem<double>&);                \
    template void name##_backward<float>(const Problem<float>&, const float*,    \
                                         const Grads<float>&);                   \
    template void name##_backward<double>(const Problem<double>&, const double*, \
                                          const Grads<double>&)

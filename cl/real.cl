// The element type of a program's data, REAL: float, or double where the host builds the
// program with -DCLMHA_F64 (the kernels of float64 layers: clmha__layer_real_options()). The
// library builds this file in front of every other. REALn are the vector types, REAL_F64 is 1
// for double.
#ifdef CLMHA_F64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define REAL_F64 1
#define REAL double
#define REAL2 double2
#define REAL4 double4
#define REAL8 double8
#define REAL16 double16
#else
#define REAL_F64 0
#define REAL float
#define REAL2 float2
#define REAL4 float4
#define REAL8 float8
#define REAL16 float16
#endif

/* The error path of the C API, from C. */
#include <stdio.h>
#include <string.h>

#include <cosa/cosa.h>

/* Returns 0 when a decreasing kv_indptr is rejected as documented. */
int check_error_path(void) {
    const int32_t qo_indptr[] = {0, 10, 20};
    const int32_t kv_indptr[] = {0, 3, 2};
    const int32_t kv_indices[] = {0, 1, 2};
    const int32_t kv_last_page_len[] = {16, 16};
    cosa_remap_args args = {0};
    cosa_remap_plan* plan = NULL;

    args.qo_indptr = qo_indptr;
    args.qo_indptr_size = 3;
    args.kv_indptr = kv_indptr;
    args.kv_indptr_size = 3;
    args.kv_indices = kv_indices;
    args.kv_indices_size = 3;
    args.kv_last_page_len = kv_last_page_len;
    args.kv_last_page_len_size = 2;
    args.num_pages = 3;
    args.page_size = 16;
    args.num_qo_heads = 1;
    args.num_kv_heads = 1;
    args.head_dim = 64;
    args.causal = true;
    args.budget = 1.0;

    if (cosa_remap_plan_create(&args, &plan) != COSA_ERROR_INVALID_ARGUMENT || plan != NULL) {
        fprintf(stderr, "FAIL: a decreasing kv_indptr was accepted\n");
        return 1;
    }
    if (strncmp(cosa_last_error(), "kv_indptr", strlen("kv_indptr")) != 0) {
        fprintf(stderr, "FAIL: error message does not name kv_indptr: %s\n", cosa_last_error());
        return 1;
    }
    printf("rejected as expected: %s\n", cosa_last_error());
    return 0;
}

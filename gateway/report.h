/* gateway/report.h — requests as the JSON the API returns (API.md). */
#ifndef RK_REPORT_H
#define RK_REPORT_H

#include <jansson.h>

#include "gateway/gateway.h"
#include "pipeline/pipeline.h"

/* The API's names of the pipeline's enums. */
const char *rk_finish_reason_name(rk_finish_reason f);
const char *rk_chunk_status_name(rk_chunk_status s);
const char *rk_chunk_source_name(rk_chunk_source s);

/* The generated text, decoded and made valid UTF-8 (malloc'ed). */
rk_status rk_report_text(const rk_tokenizer *tok, const rk_request *r, char **out);
/* The `usage` object and the `ragkv` extension object (new references). */
json_t *rk_report_usage(const rk_request *r);
json_t *rk_report_ragkv(const rk_request *r);
/* The whole text_completion object (new reference; NULL when out of memory). */
json_t *rk_report_completion(const rk_tokenizer *tok, const rk_request *r, const char *id,
                             long created, const char *model);

#endif

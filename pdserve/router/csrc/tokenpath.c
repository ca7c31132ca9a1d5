/* The router's per-token path in C: a steady request's plain tokens, from a node message to its stream's chunk.
 *
 * Two functions, each the twin of Python code that stays the reference and the fallback (pdserve/router/native.py
 * says when which runs; tests/router/test_native_path.py checks they give the same):
 *
 *   Plain(stream, text, head, after, with_ids, fault)(token_ids)
 *       SseStream._on_tokens for one plain choice: its tokens' text (ByteText.add), its chunk
 *       (ChunkFormat.event, no finish reason), held in the stream's parts (SseStream._hold).
 *   deliver(tokens, flights, source, now, gaps, slow, put) -> tokens counted
 *       The loop of RouterCore._deliver_tokens over a node message's flat plain events.
 *
 * Every object is the Python one, read and written through the C API; nothing is cached here that Python could
 * change behind it but what the constructor's arguments say is fixed for the stream's life. An exception a Python
 * line would raise is raised here too, at the same point.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
#include <string.h>

static PyObject *s_done, *s_tokens, *s_parts, *s_pending, *s_outbox, *s_hold;
static PyObject *s_steady, *s_last_token_at, *s_output, *s_inbox, *s_push_tokens;
static PyObject *encode_ascii; /* json.encoder.encode_basestring_ascii */

/* ---- Plain ------------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *stream;       /* the SseStream */
    PyObject *text;         /* its choice's ByteText: known (dict), pending (bytes) */
    PyObject *known;        /* text.known */
    PyObject *learn;        /* text.table.learn */
    PyObject *skip_special; /* text.skip_special */
    PyObject *head;         /* bytes: the chunk up to its text */
    PyObject *after;        /* bytes: after the text, through the finish reason (null) */
    int with_ids;           /* the chunk carries its token ids */
    PyObject *fault;        /* called with the exception when the chunk cannot be made, as SseStream._fault */
    PyObject *done;         /* stream.done, a future */
    PyObject *hold;         /* stream.outbox.hold */
} Plain;

static int Plain_traverse(Plain *self, visitproc visit, void *arg) {
    Py_VISIT(self->stream); Py_VISIT(self->text); Py_VISIT(self->known); Py_VISIT(self->learn);
    Py_VISIT(self->skip_special); Py_VISIT(self->head); Py_VISIT(self->after); Py_VISIT(self->fault);
    Py_VISIT(self->done); Py_VISIT(self->hold);
    return 0;
}

static int Plain_clear(Plain *self) {
    Py_CLEAR(self->stream); Py_CLEAR(self->text); Py_CLEAR(self->known); Py_CLEAR(self->learn);
    Py_CLEAR(self->skip_special); Py_CLEAR(self->head); Py_CLEAR(self->after); Py_CLEAR(self->fault);
    Py_CLEAR(self->done); Py_CLEAR(self->hold);
    return 0;
}

static void Plain_dealloc(Plain *self) {
    PyObject_GC_UnTrack(self);
    Plain_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Plain_init(Plain *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"stream", "text", "head", "after", "with_ids", "fault", NULL};
    PyObject *stream, *text, *head, *after, *fault;
    int with_ids;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOSSpO", names, &stream, &text, &head, &after, &with_ids, &fault))
        return -1;
    if (self->stream != NULL) {
        PyErr_SetString(PyExc_TypeError, "Plain is initialised once");
        return -1;
    }
    PyObject *known = PyObject_GetAttrString(text, "known");
    if (known != NULL && !PyDict_CheckExact(known)) {
        Py_CLEAR(known);
        PyErr_SetString(PyExc_TypeError, "Plain: text.known must be a dict");
    }
    PyObject *table = known ? PyObject_GetAttrString(text, "table") : NULL;
    PyObject *learn = table ? PyObject_GetAttrString(table, "learn") : NULL;
    Py_XDECREF(table);
    PyObject *skip = learn ? PyObject_GetAttrString(text, "skip_special") : NULL;
    PyObject *done = skip ? PyObject_GetAttr(stream, s_done) : NULL;
    PyObject *outbox = done ? PyObject_GetAttr(stream, s_outbox) : NULL;
    PyObject *hold = outbox ? PyObject_GetAttr(outbox, s_hold) : NULL;
    Py_XDECREF(outbox);
    if (hold == NULL) {
        Py_XDECREF(known);
        Py_XDECREF(learn);
        Py_XDECREF(skip);
        Py_XDECREF(done);
        return -1;
    }
    self->stream = Py_NewRef(stream); self->text = Py_NewRef(text); self->known = known;
    self->learn = learn; self->skip_special = skip; self->head = Py_NewRef(head);
    self->after = Py_NewRef(after); self->with_ids = with_ids; self->fault = Py_NewRef(fault);
    self->done = done; self->hold = hold;
    return 0;
}

/* A token's bytes from the table, learned (a Python call) the first time; a new reference. */
static PyObject *token_bytes(Plain *self, PyObject *t) {
    PyObject *data = PyDict_GetItemWithError(self->known, t);
    if (data != NULL) return Py_NewRef(data);
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallFunctionObjArgs(self->learn, t, self->skip_special, NULL);
}

/* ByteText.add: the ids' bytes after what is pending, decoded as UTF-8 as far as they settle. */
static PyObject *text_of(Plain *self, PyObject *ids) {
    PyObject *pending = PyObject_GetAttr(self->text, s_pending);
    if (pending == NULL) return NULL;
    PyObject *data = pending; /* grows to pending + every token's bytes */
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(ids); k++) { /* read at every pass: `learn` runs Python */
        PyObject *t = Py_NewRef(PyList_GET_ITEM(ids, k));
        PyObject *b = token_bytes(self, t);
        Py_DECREF(t);
        if (b == NULL) { Py_DECREF(data); return NULL; }
        PyBytes_Concat(&data, b); /* `pending + b"".join(parts)`: the same bytes */
        Py_DECREF(b);
        if (data == NULL) return NULL;
    }
    if (!PyBytes_Check(data)) {
        Py_DECREF(data);
        PyErr_SetString(PyExc_TypeError, "a token's bytes must be bytes");
        return NULL;
    }
    Py_ssize_t used = 0;
    PyObject *text = PyUnicode_DecodeUTF8Stateful(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), "replace", &used);
    if (text == NULL) { Py_DECREF(data); return NULL; }
    PyObject *rest = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + used, PyBytes_GET_SIZE(data) - used);
    Py_DECREF(data);
    if (rest == NULL || PyObject_SetAttr(self->text, s_pending, rest) < 0) {
        Py_XDECREF(rest);
        Py_DECREF(text);
        return NULL;
    }
    Py_DECREF(rest);
    return text;
}

/* `, "token_ids": [1, 2]`, as ChunkFormat.event writes it (", ".join(map(str, ids))); a new reference. */
static PyObject *ids_part(PyObject *ids) {
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *strs = PyList_New(n);
    if (strs == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *s = PyObject_Str(PyList_GET_ITEM(ids, k));
        if (s == NULL) { Py_DECREF(strs); return NULL; }
        PyList_SET_ITEM(strs, k, s);
    }
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *joined = sep ? PyUnicode_Join(sep, strs) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(strs);
    if (joined == NULL) return NULL;
    PyObject *part = PyUnicode_FromFormat(", \"token_ids\": [%U]", joined);
    Py_DECREF(joined);
    if (part == NULL) return NULL;
    PyObject *out = PyUnicode_AsUTF8String(part);
    Py_DECREF(part);
    return out;
}

/* ChunkFormat.event(text, ids, None).encode(); a new reference. */
static PyObject *chunk_of(Plain *self, PyObject *text, PyObject *ids) {
    PyObject *escaped = PyObject_CallOneArg(encode_ascii, text);
    if (escaped == NULL) return NULL;
    PyObject *esc = PyUnicode_AsUTF8String(escaped);
    Py_DECREF(escaped);
    if (esc == NULL) return NULL;
    PyObject *ids_b = NULL;
    if (self->with_ids && (ids_b = ids_part(ids)) == NULL) { Py_DECREF(esc); return NULL; }
    static const char end[] = "}]}\n\n";
    Py_ssize_t lh = PyBytes_GET_SIZE(self->head), le = PyBytes_GET_SIZE(esc), la = PyBytes_GET_SIZE(self->after);
    Py_ssize_t li = ids_b ? PyBytes_GET_SIZE(ids_b) : 0, lend = (Py_ssize_t)sizeof(end) - 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, lh + le + la + li + lend);
    if (out != NULL) {
        char *p = PyBytes_AS_STRING(out);
        memcpy(p, PyBytes_AS_STRING(self->head), lh); p += lh;
        memcpy(p, PyBytes_AS_STRING(esc), le); p += le;
        memcpy(p, PyBytes_AS_STRING(self->after), la); p += la;
        if (li) { memcpy(p, PyBytes_AS_STRING(ids_b), li); p += li; }
        memcpy(p, end, lend);
    }
    Py_DECREF(esc);
    Py_XDECREF(ids_b);
    return out;
}

/* The try block of SseStream._on_tokens: count the tokens, make the chunk. */
static PyObject *count_and_chunk(Plain *self, PyObject *ids) {
    PyObject *tokens = PyObject_GetAttr(self->stream, s_tokens);
    if (tokens == NULL) return NULL;
    PyObject *n = PyLong_FromSsize_t(PyList_GET_SIZE(ids));
    PyObject *sum = n ? PyNumber_InPlaceAdd(tokens, n) : NULL;
    Py_DECREF(tokens);
    Py_XDECREF(n);
    if (sum == NULL) return NULL;
    int bad = PyObject_SetAttr(self->stream, s_tokens, sum);
    Py_DECREF(sum);
    if (bad) return NULL;
    PyObject *text = text_of(self, ids);
    if (text == NULL) return NULL;
    PyObject *chunk = chunk_of(self, text, ids);
    Py_DECREF(text);
    return chunk;
}

/* `except Exception as e: fault(e)`: a BaseException that is not an Exception goes on up. */
static int handle_fault(Plain *self) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallOneArg(self->fault, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* SseStream._hold: `if not self.parts: self.outbox.hold(self)`, then `self.parts.append(data)` (read again: hold
 * ran Python). */
static int hold(Plain *self, PyObject *chunk) {
    PyObject *parts = PyObject_GetAttr(self->stream, s_parts);
    int truth = parts ? PyObject_IsTrue(parts) : -1;
    Py_XDECREF(parts);
    if (truth < 0) return -1;
    if (!truth) {
        PyObject *r = PyObject_CallOneArg(self->hold, self->stream);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    parts = PyObject_GetAttr(self->stream, s_parts);
    if (parts == NULL) return -1;
    int bad;
    if (PyList_CheckExact(parts)) {
        bad = PyList_Append(parts, chunk);
    } else {
        PyObject *r = PyObject_CallMethod(parts, "append", "O", chunk);
        bad = r == NULL;
        Py_XDECREF(r);
    }
    Py_DECREF(parts);
    return bad ? -1 : 0;
}

static PyObject *plain_push(Plain *self, PyObject *ids) {
    if (self->stream == NULL) {
        PyErr_SetString(PyExc_TypeError, "Plain was not initialised");
        return NULL;
    }
    if (!PyList_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "Plain takes a list of token ids");
        return NULL;
    }
    PyObject *is_done = PyObject_CallMethodNoArgs(self->done, s_done);
    if (is_done == NULL) return NULL;
    int done = PyObject_IsTrue(is_done);
    Py_DECREF(is_done);
    if (done < 0) return NULL;
    if (done) Py_RETURN_NONE;
    /* the try block: count the tokens, make the chunk, hold it; `except Exception as e: fault(e)` */
    PyObject *chunk = count_and_chunk(self, ids);
    int bad = chunk == NULL || hold(self, chunk) < 0;
    Py_XDECREF(chunk);
    if (bad && handle_fault(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Plain_call(Plain *self, PyObject *args, PyObject *kwds) {
    PyObject *ids;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Plain takes one positional argument");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O", &ids)) return NULL;
    return plain_push(self, ids);
}

static PyTypeObject PlainType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdserve_tokenpath.Plain",
    .tp_basicsize = sizeof(Plain),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A plain choice's tokens to its stream's chunk (SseStream._on_tokens).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Plain_init,
    .tp_dealloc = (destructor)Plain_dealloc,
    .tp_traverse = (traverseproc)Plain_traverse,
    .tp_clear = (inquiry)Plain_clear,
    .tp_call = (ternaryfunc)Plain_call,
};

/* ---- deliver ----------------------------------------------------------------------------------------------- */

/* One steady request's tokens: the gap, the clock, the output, then its stream (the body of the loop's `if`). */
static int deliver_steady(PyObject *flight, PyObject *rid, PyObject *ids, PyObject *now, PyObject *gaps,
                          PyObject *put) {
    PyObject *last = PyObject_GetAttr(flight, s_last_token_at);
    PyObject *gap = last ? PyNumber_Subtract(now, last) : NULL;
    Py_XDECREF(last);
    if (gap == NULL) return -1;
    int bad = PyList_Append(gaps, gap);
    Py_DECREF(gap);
    if (bad || PyObject_SetAttr(flight, s_last_token_at, now) < 0) return -1;
    PyObject *output = PyObject_GetAttr(flight, s_output);
    PyObject *grown = output ? PyNumber_InPlaceAdd(output, ids) : NULL;
    Py_XDECREF(output);
    if (grown == NULL) return -1;
    bad = PyObject_SetAttr(flight, s_output, grown);
    Py_DECREF(grown);
    if (bad) return -1;
    PyObject *inbox = PyObject_GetAttr(flight, s_inbox);
    PyObject *push = inbox ? PyObject_GetAttr(inbox, s_push_tokens) : NULL;
    PyObject *r = NULL;
    if (push == Py_None)
        r = PyObject_CallFunctionObjArgs(put, inbox, rid, ids, NULL);
    else if (push != NULL && Py_IS_TYPE(push, &PlainType))
        r = plain_push((Plain *)push, ids);
    else if (push != NULL)
        r = PyObject_CallOneArg(push, ids);
    Py_XDECREF(inbox);
    Py_XDECREF(push);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *deliver(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "deliver(tokens, flights, source, now, gaps, slow, put)");
        return NULL;
    }
    PyObject *tokens = args[0], *flights = args[1], *source = args[2], *now = args[3], *gaps = args[4];
    PyObject *slow = args[5], *put = args[6];
    if (!PyList_CheckExact(tokens) || !PyDict_CheckExact(flights) || !PyList_CheckExact(gaps)) {
        PyErr_SetString(PyExc_TypeError, "deliver takes the flat list, the flights (a dict) and a list for gaps");
        return NULL;
    }
    Py_ssize_t count = 0, n = PyList_GET_SIZE(tokens); /* `range(0, len(tokens), 2)`: its length read once */
    for (Py_ssize_t k = 0; k < n; k += 2) {
        if (k + 1 >= PyList_GET_SIZE(tokens)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return NULL;
        }
        PyObject *rid = PyList_GET_ITEM(tokens, k), *ids = PyList_GET_ITEM(tokens, k + 1);
        Py_INCREF(rid);
        Py_INCREF(ids); /* the list may change under a Python call */
        PyObject *flight = PyDict_GetItemWithError(flights, rid);
        int bad = 0;
        if (flight != NULL) {
            Py_INCREF(flight);
            PyObject *steady = PyObject_GetAttr(flight, s_steady);
            int is_list = PyList_Check(ids);
            if (steady == NULL) {
                bad = 1;
            } else if (steady == source && is_list && PyList_GET_SIZE(ids)) {
                count += PyList_GET_SIZE(ids); /* `count += len(token_ids)` comes before the push */
                bad = deliver_steady(flight, rid, ids, now, gaps, put) < 0;
            } else {
                PyObject *r = PyObject_CallFunctionObjArgs(slow, rid, ids, source, NULL);
                bad = r == NULL;
                Py_XDECREF(r);
            }
            Py_XDECREF(steady);
            Py_DECREF(flight);
        } else {
            bad = PyErr_Occurred() != NULL;
        }
        Py_DECREF(rid);
        Py_DECREF(ids);
        if (bad) return NULL;
    }
    return PyLong_FromSsize_t(count);
}

/* ---- the module ------------------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"deliver", (PyCFunction)(void (*)(void))deliver, METH_FASTCALL,
     "deliver(tokens, flights, source, now, gaps, slow, put) -> tokens counted: RouterCore._deliver_tokens's loop."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "pdserve_tokenpath", .m_size = -1, .m_methods = methods,
};

static int intern(PyObject **slot, const char *name) {
    *slot = PyUnicode_InternFromString(name);
    return *slot == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit_pdserve_tokenpath(void) {
    if (intern(&s_done, "done") || intern(&s_tokens, "tokens") || intern(&s_parts, "parts") ||
        intern(&s_pending, "pending") || intern(&s_outbox, "outbox") || intern(&s_hold, "hold") ||
        intern(&s_steady, "steady") || intern(&s_last_token_at, "last_token_at") || intern(&s_output, "output") ||
        intern(&s_inbox, "inbox") || intern(&s_push_tokens, "push_tokens"))
        return NULL;
    PyObject *json_encoder = PyImport_ImportModule("json.encoder");
    if (json_encoder == NULL) return NULL;
    encode_ascii = PyObject_GetAttrString(json_encoder, "encode_basestring_ascii");
    Py_DECREF(json_encoder);
    if (encode_ascii == NULL || PyType_Ready(&PlainType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Plain", (PyObject *)&PlainType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

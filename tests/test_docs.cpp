// test_docs.cpp: the documentation checks, built as their own binary (make check runs ./check_docs;
// make test does not: a student who changes a kernel should see the test that catches the change,
// not a stale quote). Catch2 v2.
//
//   [readme]     every measured figure in README.md is what its data file says, rounded as quoted
//                (lab/readme-figures.txt names the data file of each)
//   [notes]      the kernel code NOTES.md quotes is still the code in flash.cu
//   [data]       every file in lab/data/ and lab/patches/ is cited by its path, and every such
//                citation names a file that exists (lab/uncited-data.sh lists the uncited ones)
//   [exercises]  every exercise patch in exercises/ has its log, current with the sources,
//                and NOTES.md states the outcome the log shows
//
// They read the files relative to the working directory: run ./check_docs from the root.
//
// How README.md names its sources. lab/readme-figures.txt binds each measured figure of
// README.md to where it comes from, paragraph by paragraph (README.md itself carries no bindings):
//
//   figures: the forward ran at
//   "the forward ran at # TFLOP/s": lab/data/demo-default.log "flash forward ... # TFLOP/s"
//   "bf16 runs at #–#× fp16": lab/data/bench-e22bf88-bf16.csv seq<=8192 flash_fwd_tflops
//       over lab/data/bench-e22bf88-fp16.csv flash_fwd_tflops on dim,seq,causal
//
// A block starts with `figures: TEXT`, TEXT a piece of one line of README.md that must be in
// exactly one of its paragraphs (a paragraph, list or table runs to its first blank line); the
// lines after it, up to the next `figures:`, bind that paragraph. Lines starting with # are
// comments. Each quoted text is a piece of the paragraph, with # where a figure stands and ... for
// any text; #–# is a range. After the colon comes a lookup (it may go on over further lines): a
// file (its path from the root), then what to read in it.
//   .csv (lines starting with # are comments; the first other line names the columns):
//     key=value  key=a|b  key<=value  key>=value    the rows to read
//     column  column/1024  |column-column|           a row's value (1024: MiB to GiB)
//     max  min                                      the largest or smallest row, not the first
//   .log or .txt: one "text with # where the number is"; every line that holds it is a row, and
//     {name} in it reads a field of the row (as a .csv's column) and ... skips any text
//   .cu or .cpp: `kernel NAME`, the kernel's lines of code as NOTES.md section 6 counts them
//     (from the __global__ line to the closing brace, blank and comment-only lines left out),
//     or `lines`, all the file's lines
//   ... over LOOKUP on key,key: the first lookup's value divided by the second's, row by row; a
//     row's divisor is the second lookup's first row with the same values of the keys
// A single figure is the value of the first row the lookup selects (with key=a|b, of the first
// row for each of a and b: both must agree); a range is the smallest and the largest value over
// every row it selects. A figure must read as its value printed with the figure's decimals.
//
// A table's block names its columns and what each number in a cell is, then a lookup per row,
// by the row's first cell; each number is read with the row's lookup, its column's terms and its
// place in the cell's terms added. A cells: line under a row's lookup is that row's own:
//   columns: dim=64 seq=2048, dim=128 seq=2048
//   cells: causal=0, causal=1                        "26.1 (24.0)": no mask, then causal
//   "fp32 flash forward": lab/data/bench_h100.csv dtype=fp32 flash_fwd_tflops
//   "fp16 standard attention": lab/data/bench_h100.csv dtype=fp16 causal=0
//     cells: std_fwd_tflops, std_bwd_tflops          "44 / 111": forward, then backward
//
// So a re-measurement is one edit of the data file and one of the README; this test names every
// figure that no longer agrees, at its README line and its binding's line. As a net for new
// figures, any number in README.md followed by a unit of speed, time, memory, ratio or size
// (TFLOP/s, ms, s, MiB, GiB, ×, %, lines) must be one that a binding checks.

#include "test_util.h"

#include <unistd.h>  // getpid

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <stdexcept>

namespace {

// ---------------------------------------------------------------------------------------------
// Lookups: which rows of which file, and what value each row gives

struct Filter {
    std::string key, op;              // op: "=", "<=" or ">="
    std::vector<std::string> values;  // key=a|b: either
};

struct Lookup {
    std::string file;
    std::vector<Filter> filters;
    std::string value;             // a .csv's column expression, a text file's pattern, or a
                                   // source file's `kernel NAME` or `lines`
    std::string pick;              // "" (the first row), "max" or "min"
    std::shared_ptr<Lookup> over;  // the divisor, or none
    std::vector<std::string> on;   // the keys that pair a row with its divisor's row
};

struct Row {
    std::map<std::string, std::string> fields;
    double value = 0;
    std::string where;  // "file:line"
};

bool ends_with(const std::string& s, const std::string& end) {
    return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

std::vector<std::string> split(const std::string& s, char by) {
    std::vector<std::string> parts;
    std::stringstream in(s);
    for (std::string part; std::getline(in, part, by);) parts.push_back(part);
    return parts;
}

std::string trimmed(const std::string& s) {
    const size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// Words separated by spaces, a "quoted text" being one word (quotes kept).
std::vector<std::string> words(const std::string& s) {
    std::vector<std::string> out;
    for (size_t at = s.find_first_not_of(' '); at != std::string::npos;
         at = s.find_first_not_of(' ', at)) {
        if (s[at] == '"') {
            const size_t end = s.find('"', at + 1);
            if (end == std::string::npos) throw std::runtime_error("unclosed quote in: " + s);
            out.push_back(s.substr(at, end - at + 1));
            at = end + 1;
        } else {
            const size_t end = std::min(s.find(' ', at), s.size());
            out.push_back(s.substr(at, end - at));
            at = end;
        }
    }
    return out;
}

// One word of a lookup, after its file: a filter, a pick, or the value.
void add_term(Lookup& l, const std::string& term) {
    if (term.size() >= 2 && term.front() == '"') {  // a text file's pattern
        l.value = term.substr(1, term.size() - 2);
        return;
    }
    if (term == "max" || term == "min") {
        l.pick = term;
        return;
    }
    for (const char* op : {"<=", ">=", "="}) {
        const size_t at = term.find(op);
        if (at == std::string::npos || at == 0) continue;
        const std::string alternatives = term.substr(at + std::strlen(op));
        l.filters.push_back({term.substr(0, at), op, split(alternatives, '|')});
        return;
    }
    if (!l.value.empty()) throw std::runtime_error("two values: " + l.value + " and " + term);
    l.value = term;
}

bool is_source(const std::string& file) {
    return ends_with(file, ".cu") || ends_with(file, ".cpp");
}

Lookup parse_lookup(const std::string& text) {
    const std::vector<std::string> w = words(text);
    if (w.empty()) throw std::runtime_error("a figure without a lookup");
    Lookup l;
    l.file = w[0];
    Lookup* into = &l;
    for (size_t k = 1; k < w.size(); ++k) {
        if (w[k] == "over" && k + 1 < w.size() && !l.over) {
            l.over = std::make_shared<Lookup>();
            l.over->file = w[++k];
            into = l.over.get();
        } else if (w[k] == "on" && k + 1 < w.size() && l.over) {
            l.on = split(w[++k], ',');
        } else if (is_source(l.file)) {
            into->value += (into->value.empty() ? "" : " ") + w[k];  // kernel NAME
        } else {
            add_term(*into, w[k]);
        }
    }
    if (l.over && l.on.empty()) throw std::runtime_error("`over` needs `on KEYS`: " + text);
    return l;
}

// A pattern as a regular expression: # is a number (a group), {name} a field (a group), ... any
// text, a run of spaces any whitespace (so a pattern may match across a README line break).
std::regex pattern_regex(const std::string& pattern, std::vector<std::string>* groups) {
    std::string re;
    for (size_t k = 0; k < pattern.size(); ++k) {
        const char c = pattern[k];
        if (c == '#') {
            re += "(-?[0-9]+(?:\\.[0-9]+)?)";
            groups->push_back("#");
        } else if (c == '{' && pattern.find('}', k) != std::string::npos) {
            const size_t end = pattern.find('}', k);
            groups->push_back(pattern.substr(k + 1, end - k - 1));
            re += "([^\\s,;:]+)";
            k = end;
        } else if (pattern.compare(k, 3, "...") == 0) {
            re += ".*?";
            k += 2;
        } else if (c == ' ') {
            re += "\\s+";
            while (k + 1 < pattern.size() && pattern[k + 1] == ' ') ++k;
        } else {
            if (std::strchr(".^$|()[]{}*+?\\", c)) re += '\\';
            re += c;
        }
    }
    return std::regex(re);
}

double to_number(const std::string& s, const std::string& where) {
    try {
        size_t used = 0;
        const double v = std::stod(s, &used);
        if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
    throw std::runtime_error(where + ": '" + s + "' is not a number");
}

// A .csv row's value: column, column/NUMBER, or |column-column|.
double csv_value(const std::map<std::string, std::string>& row, const std::string& expr,
                 const std::string& where) {
    const auto column = [&](const std::string& name) {
        const auto it = row.find(name);
        if (it == row.end()) throw std::runtime_error(where + " has no column " + name);
        return to_number(it->second, where);
    };
    if (expr.size() > 2 && expr.front() == '|' && expr.back() == '|') {
        const std::vector<std::string> ab = split(expr.substr(1, expr.size() - 2), '-');
        if (ab.size() != 2) throw std::runtime_error("not |a-b|: " + expr);
        return std::fabs(column(ab[0]) - column(ab[1]));
    }
    const size_t slash = expr.find('/');
    if (slash == std::string::npos) return column(expr);
    return column(expr.substr(0, slash)) / to_number(expr.substr(slash + 1), expr);
}

// The lines of code of kernel `name` in a source file, counted as NOTES.md section 6 does.
int kernel_lines(const std::vector<std::string>& src, const std::string& name) {
    for (size_t k = 0; k < src.size(); ++k) {
        if (src[k].rfind(name + "(", 0) != 0) continue;  // the definition's name line
        size_t first = k;
        while (first > 0 && src[first].find("__global__") == std::string::npos) --first;
        int depth = 0, lines = 0;
        bool opened = false;
        for (size_t n = first; n < src.size(); ++n) {
            const std::string code = src[n].substr(0, src[n].find("//"));
            if (!code.empty()) ++lines;
            for (char c : code) depth += c == '{' ? 1 : c == '}' ? -1 : 0;
            opened = opened || code.find('{') != std::string::npos;
            if (opened && depth == 0) return lines;
        }
    }
    throw std::runtime_error("no kernel " + name + " defined at the start of a line");
}

// Every row of l's file (before any filter), with l's value.
std::vector<Row> file_rows(const Lookup& l) {
    const std::vector<std::string> lines = source_lines(l.file);
    std::vector<Row> rows;
    if (is_source(l.file)) {
        Row r;
        r.where = l.file;
        if (l.value == "lines") r.value = double(lines.size());
        else if (l.value.rfind("kernel ", 0) == 0) r.value = kernel_lines(lines, l.value.substr(7));
        else throw std::runtime_error(l.file + ": read `kernel NAME` or `lines`, not " + l.value);
        rows.push_back(r);
    } else if (ends_with(l.file, ".csv")) {
        std::vector<std::string> header;
        for (size_t n = 0; n < lines.size(); ++n) {
            if (lines[n].empty() || lines[n][0] == '#') continue;
            const std::vector<std::string> cells = split(lines[n], ',');
            if (header.empty()) {
                header = cells;
                continue;
            }
            Row r;
            r.where = l.file + ":" + std::to_string(n + 1);
            for (size_t c = 0; c < cells.size() && c < header.size(); ++c)
                r.fields[header[c]] = cells[c];
            r.value = csv_value(r.fields, l.value, r.where);
            rows.push_back(r);
        }
    } else {
        std::vector<std::string> groups;
        const std::regex re = pattern_regex(l.value, &groups);
        if (std::count(groups.begin(), groups.end(), "#") != 1)
            throw std::runtime_error(l.file + ": its pattern needs one #: \"" + l.value + "\"");
        for (size_t n = 0; n < lines.size(); ++n) {
            std::smatch m;
            if (!std::regex_search(lines[n], m, re)) continue;
            Row r;
            r.where = l.file + ":" + std::to_string(n + 1);
            for (size_t g = 0; g < groups.size(); ++g) {
                if (groups[g] == "#") r.value = to_number(m[g + 1], r.where);
                else r.fields[groups[g]] = m[g + 1];
            }
            rows.push_back(r);
        }
    }
    return rows;
}

bool passes(const Row& r, const Filter& f) {
    const auto it = r.fields.find(f.key);
    if (it == r.fields.end()) throw std::runtime_error(r.where + " has no field " + f.key);
    for (const std::string& v : f.values) {
        if (f.op == "=" && it->second == v) return true;
        if (f.op != "=") {
            const double x = to_number(it->second, r.where), bound = to_number(v, f.key);
            if (f.op == "<=" ? x <= bound : x >= bound) return true;
        }
    }
    return false;
}

// The rows l selects, in file order, each with its value (divided by its divisor's, with over).
std::vector<Row> selected_rows(const Lookup& l) {
    std::vector<Row> rows;
    for (const Row& r : file_rows(l)) {
        if (std::all_of(l.filters.begin(), l.filters.end(),
                        [&](const Filter& f) { return passes(r, f); }))
            rows.push_back(r);
    }
    if (!l.over) return rows;
    const std::vector<Row> divisors = selected_rows(*l.over);
    for (Row& r : rows) {
        const auto pair = std::find_if(divisors.begin(), divisors.end(), [&](const Row& d) {
            return std::all_of(l.on.begin(), l.on.end(), [&](const std::string& key) {
                return d.fields.count(key) && r.fields.count(key) &&
                       d.fields.at(key) == r.fields.at(key);
            });
        });
        if (pair == divisors.end()) {
            std::string keys;
            for (const std::string& key : l.on)
                keys += " " + key + "=" + (r.fields.count(key) ? r.fields.at(key) : "?");
            throw std::runtime_error(l.over->file + " has no row with" + keys + " for " + r.where);
        }
        r.value /= pair->value;
        r.where += " / " + pair->where;
    }
    return rows;
}

// One lookup per alternative of its key=a|b filters (a single figure must hold for each).
std::vector<Lookup> alternatives(const Lookup& l) {
    for (size_t f = 0; f < l.filters.size(); ++f) {
        if (l.filters[f].op != "=" || l.filters[f].values.size() < 2) continue;
        std::vector<Lookup> out;
        for (const std::string& v : l.filters[f].values) {
            Lookup one = l;
            one.filters[f].values = {v};
            for (const Lookup& each : alternatives(one)) out.push_back(each);
        }
        return out;
    }
    return {l};
}

std::string printed(double v, int decimals) {
    std::ostringstream out;
    out << std::fixed << std::setprecision(decimals) << v;
    return out.str();
}

int decimals_of(const std::string& figure) {
    const size_t dot = figure.find('.');
    return dot == std::string::npos ? 0 : int(figure.size() - dot - 1);
}

std::string value_at(const Row& r) {
    std::ostringstream out;
    out << std::setprecision(6) << r.value << " (" << r.where << ")";
    return out.str();
}

bool by_value(const Row& a, const Row& b) { return a.value < b.value; }

// What is wrong with a figure (one number, or a range of two) read with lookup l; "" if nothing.
std::string figure_problem(const std::vector<std::string>& figure, const Lookup& l) {
    if (figure.size() == 2) {
        const std::vector<Row> rows = selected_rows(l);
        if (rows.empty()) return "no row of " + l.file + " matches";
        const Row& lo = *std::min_element(rows.begin(), rows.end(), by_value);
        const Row& hi = *std::max_element(rows.begin(), rows.end(), by_value);
        const std::string want = printed(lo.value, decimals_of(figure[0])) + "–" +
                                 printed(hi.value, decimals_of(figure[1]));
        if (want == figure[0] + "–" + figure[1]) return "";
        return "should be " + want + ": " + std::to_string(rows.size()) + " rows of " + l.file +
               " run from " + value_at(lo) + " to " + value_at(hi);
    }
    for (const Lookup& one : alternatives(l)) {
        const std::vector<Row> rows = selected_rows(one);
        if (rows.empty()) return "no row of " + l.file + " matches";
        const Row& r = one.pick == "max"   ? *std::max_element(rows.begin(), rows.end(), by_value)
                       : one.pick == "min" ? *std::min_element(rows.begin(), rows.end(), by_value)
                                           : rows.front();
        const std::string want = printed(r.value, decimals_of(figure[0]));
        if (want != figure[0]) return "should be " + want + ": " + value_at(r);
    }
    return "";
}

// ---------------------------------------------------------------------------------------------
// The document and its bindings: each block of the bindings file names a paragraph or a table of
// the document, and binds its figures to their data

const std::regex kNumber("[0-9]+(?:\\.[0-9]+)?");

struct Report {
    std::vector<std::string> problems;
    int figures = 0;                            // figures checked
    std::set<std::pair<size_t, size_t>> seen;   // (line, column) where each starts
};

// One figure: checks it, counts it, and remembers where it stands. `binding` says where its
// lookup is written ("file:line").
void check_figure(Report& rep, const std::string& doc, size_t line, size_t col,
                  const std::vector<std::string>& figure, const Lookup& l,
                  const std::string& what, const std::string& binding) {
    ++rep.figures;
    rep.seen.insert({line, col});
    std::string problem;
    try {
        problem = figure_problem(figure, l);
    } catch (const std::exception& e) {
        problem = e.what();
    }
    if (problem.empty()) return;
    const std::string shown = figure.size() == 2 ? figure[0] + "–" + figure[1] : figure[0];
    rep.problems.push_back(doc + ":" + std::to_string(line + 1) + ": " + shown + " (" + what +
                           ") from " + l.file + " " + problem + " (bound at " + binding + ")");
}

struct Spec {
    std::string text;    // a pattern in the paragraph, or a table row's first cell
    std::string lookup;  // what follows the colon
    std::string where;   // "file:line" of the binding
};

// One block of a bindings file: `figures: KEY`, then what binds the paragraph KEY is in.
struct Binding {
    std::string key;
    std::string where;                 // "file:line" of the `figures:` line
    std::vector<Spec> specs;
    std::vector<std::string> columns;  // a table's columns
    std::string cells;                 // a table's cells, where a row names none of its own
};

// The blocks of a bindings file (its lines trimmed, as source_lines gives them).
std::vector<Binding> read_bindings(const std::vector<std::string>& lines, const std::string& file,
                                   std::vector<std::string>* problems) {
    std::vector<Binding> out;
    for (size_t n = 0; n < lines.size(); ++n) {
        const std::string& l = lines[n];
        const std::string at = file + ":" + std::to_string(n + 1);
        if (l.empty() || l[0] == '#') continue;
        if (l.rfind("figures:", 0) == 0) {
            out.push_back({trimmed(l.substr(8)), at, {}, {}, ""});
            if (out.back().key.empty()) problems->push_back(at + ": `figures:` names no text");
        } else if (out.empty()) {
            problems->push_back(at + ": a binding before the first `figures:` line");
        } else if (l.rfind("columns:", 0) == 0) {
            out.back().columns = split(l.substr(8), ',');
        } else if (l.rfind("cells:", 0) == 0 && !out.back().specs.empty()) {
            out.back().specs.back().lookup += "; " + l;
        } else if (l.rfind("cells:", 0) == 0) {
            out.back().cells = l.substr(6);
        } else if (l[0] == '"' && l.find("\":", 1) != std::string::npos) {
            out.back().specs.push_back(
                {l.substr(1, l.find("\":") - 1), l.substr(l.find("\":") + 2), at});
        } else if (!out.back().specs.empty()) {
            out.back().specs.back().lookup += " " + l;  // a lookup goes on
        } else {
            problems->push_back(at + ": not \"text\": lookup, columns: or cells:");
        }
    }
    return out;
}

// A table: every row needs a spec; every number of a cell is one figure.
void check_table(Report& rep, const std::string& doc, const std::vector<std::string>& lines,
                 size_t first, size_t end, const Binding& b) {
    std::set<std::string> used;
    for (size_t n = first + 2; n < end; ++n) {  // past the header and the |---| line
        const std::vector<std::string> cell = split(lines[n], '|');
        const std::string label = cell.size() > 1 ? trimmed(cell[1]) : "";
        const auto spec = std::find_if(b.specs.begin(), b.specs.end(),
                                       [&](const Spec& s) { return s.text == label; });
        if (spec == b.specs.end()) {
            rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": the row \"" + label +
                                   "\" has no lookup in its binding (" + b.where + ")");
            continue;
        }
        used.insert(label);
        std::string base = spec->lookup, row_cells = b.cells;
        if (base.find("; cells:") != std::string::npos) {
            row_cells = base.substr(base.find("; cells:") + 8);
            base = base.substr(0, base.find("; cells:"));
        }
        const std::vector<std::string> slots = split(row_cells, ',');
        if (cell.size() - 2 != b.columns.size())
            rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": " +
                                   std::to_string(cell.size() - 2) + " cells, but " +
                                   std::to_string(b.columns.size()) + " columns named at " +
                                   b.where);
        size_t col = lines[n].find('|', 1);  // where the cell after the label starts
        for (size_t c = 2; c < cell.size() && c - 2 < b.columns.size(); ++c) {
            std::vector<std::pair<std::string, size_t>> numbers;
            for (auto it = std::sregex_iterator(cell[c].begin(), cell[c].end(), kNumber);
                 it != std::sregex_iterator(); ++it)
                numbers.push_back({it->str(), col + 1 + size_t(it->position())});
            if (numbers.size() != slots.size())
                rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": \"" + cell[c] +
                                       "\" holds " + std::to_string(numbers.size()) +
                                       " numbers; its binding (" + spec->where + ") says " +
                                       std::to_string(slots.size()));
            for (size_t k = 0; k < numbers.size() && k < slots.size(); ++k) {
                try {
                    Lookup l = parse_lookup(base);
                    for (const std::string& t : words(b.columns[c - 2] + " " + slots[k]))
                        add_term(l, t);
                    check_figure(rep, doc, n, numbers[k].second, {numbers[k].first}, l,
                                 label + ", column " + std::to_string(c - 1), spec->where);
                } catch (const std::exception& e) {
                    rep.problems.push_back(spec->where + ": " + e.what());
                }
            }
            col += cell[c].size() + 1;
        }
    }
    for (const Spec& s : b.specs)
        if (!used.count(s.text))
            rep.problems.push_back(s.where + ": no row \"" + s.text + "\" in the table at " +
                                   doc + ":" + std::to_string(first + 1));
}

// A paragraph: each spec's pattern must be in it, its # a figure (#–#: a range).
void check_paragraph(Report& rep, const std::string& doc, const std::vector<std::string>& lines,
                     size_t first, size_t end, const std::vector<Spec>& specs) {
    std::string text;
    for (size_t n = first; n < end; ++n) text += lines[n] + (n + 1 < end ? "\n" : "");
    for (const Spec& s : specs) {
        const std::string at = s.where + ": ";
        try {
            std::vector<std::string> groups;
            std::smatch m;
            if (!std::regex_search(text, m, pattern_regex(s.text, &groups))) {
                rep.problems.push_back(at + "\"" + s.text + "\" is not in the paragraph at " +
                                       doc + ":" + std::to_string(first + 1));
                continue;
            }
            if (groups.empty() || groups.size() > 2 ||
                std::count(groups.begin(), groups.end(), "#") != long(groups.size()))
                throw std::runtime_error("\"" + s.text + "\": a figure is # or #–#");
            const size_t pos = size_t(m.position(1));
            const size_t line = first + size_t(std::count(text.begin(), text.begin() + pos, '\n'));
            const size_t col = pos - (text.rfind('\n', pos) == std::string::npos
                                          ? 0 : text.rfind('\n', pos) + 1);
            std::vector<std::string> figure;
            for (size_t g = 1; g <= groups.size(); ++g) figure.push_back(m[g]);
            check_figure(rep, doc, line, col, figure, parse_lookup(s.lookup), s.text, s.where);
        } catch (const std::exception& e) {
            rep.problems.push_back(at + e.what());
        }
    }
}

// Checks a document (its lines, trimmed, as source_lines gives them) against the blocks of its
// bindings file, then looks for figures with a unit that no binding checks.
Report check_document(const std::vector<std::string>& lines, const std::string& doc,
                      const std::vector<std::string>& bindings, const std::string& file) {
    Report rep;
    std::vector<std::pair<size_t, size_t>> paragraphs;  // [first, end): runs of non-blank lines
    for (size_t n = 0; n < lines.size(); ++n) {
        if (lines[n].empty()) continue;
        size_t end = n;
        while (end < lines.size() && !lines[end].empty()) ++end;
        paragraphs.push_back({n, end});
        n = end;
    }
    for (const Binding& b : read_bindings(bindings, file, &rep.problems)) {
        if (b.key.empty()) continue;
        std::vector<std::pair<size_t, size_t>> found;
        for (const auto& p : paragraphs)
            if (std::any_of(lines.begin() + long(p.first), lines.begin() + long(p.second),
                            [&](const std::string& l) { return l.find(b.key) != l.npos; }))
                found.push_back(p);
        if (found.size() != 1) {
            rep.problems.push_back(b.where + ": \"" + b.key + "\" is in " +
                                   (found.empty() ? std::string("no")
                                                  : std::to_string(found.size())) +
                                   " paragraphs of " + doc + "; it must be in one");
            continue;
        }
        const auto [first, end] = found[0];
        if (lines[first].rfind("|", 0) == 0)
            check_table(rep, doc, lines, first, end, b);
        else
            check_paragraph(rep, doc, lines, first, end, b.specs);
    }
    // The net: a number with a unit, outside code blocks and comments, must have been checked;
    // and the bindings live in the bindings file, not in comments of the document.
    const std::regex with_unit(
        "([0-9]+(?:\\.[0-9]+)?)(?:–[0-9]+(?:\\.[0-9]+)?)?\\*?"
        "(?: ?(?:TFLOP/s|ms|s|MiB|GiB|%|lines)(?![A-Za-z])|×)");  // "16384 × 32" is no ratio
    bool code = false, comment = false;
    for (size_t n = 0; n < lines.size(); ++n) {
        if (lines[n].rfind("```", 0) == 0) code = !code;
        if (!code && lines[n].rfind("<!-- figures", 0) == 0)
            rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": a figures comment, "
                                   "which nothing reads: bind the figures in " + file);
        if (lines[n].rfind("<!--", 0) == 0) comment = true;
        if (!code && !comment) {
            for (auto it = std::sregex_iterator(lines[n].begin(), lines[n].end(), with_unit);
                 it != std::sregex_iterator(); ++it) {
                if (rep.seen.count({n, size_t(it->position(1))})) continue;
                rep.problems.push_back(doc + ":" + std::to_string(n + 1) + ": \"" + it->str() +
                                       "\" has no binding in " + file +
                                       " naming where it comes from");
            }
        }
        if (comment && ends_with(lines[n], "-->")) comment = false;
    }
    return rep;
}

}  // namespace

TEST_CASE("Every figure README.md quotes is what its data file says", "[cpu][readme]") {
    const Report rep = check_document(source_lines("README.md"), "README.md",
                                      source_lines("lab/readme-figures.txt"),
                                      "lab/readme-figures.txt");
    for (const std::string& problem : rep.problems) FAIL_CHECK(problem);
    INFO("lab/readme-figures.txt should check README.md's tables and its measured prose");
    CHECK(rep.figures >= 100);
}

// The check itself must be able to fail: a figure one digit off, a figure nothing binds, a binding
// whose text is not in its paragraph, a block that names no paragraph, a figures comment left in
// the document. lab/data/bench_h100.csv's fp32 forward takes no extra memory at any shape, so this
// stays true when the data is re-measured.
TEST_CASE("A figure that disagrees with its data file fails the README check", "[cpu][readme]") {
    const std::vector<std::string> bindings = {
        "# where X.md's figures come from",
        "figures: At N = 2048",
        "\"the forward takes # MiB\": lab/data/bench_h100.csv dtype=fp32 dim=64 seq=2048 causal=1",
        "flash_fwd_extra_mib"};
    const auto check = [&](const std::string& first) {
        return check_document({first, "", "Elsewhere it runs at 99 TFLOP/s."}, "X.md", bindings,
                              "B.txt");
    };
    const Report good = check("At N = 2048 the forward takes 0 MiB beyond its inputs.");
    REQUIRE(good.figures == 1);
    REQUIRE(good.problems.size() == 1);  // the net: the unchecked 99 TFLOP/s
    CHECK_THAT(good.problems[0], Catch::Contains("X.md:3") && Catch::Contains("99 TFLOP/s"));

    const Report bad = check("At N = 2048 the forward takes 1 MiB beyond its inputs.");
    REQUIRE(bad.problems.size() == 2);
    CHECK_THAT(bad.problems[0], Catch::Contains("X.md:1: 1 (the forward takes # MiB)") &&
                                    Catch::Contains("bench_h100.csv") &&
                                    Catch::Contains("should be 0") && Catch::Contains("B.txt:3"));

    const Report missing = check("At N = 2048 the forward's memory is not quoted here.");
    REQUIRE(missing.problems.size() == 2);
    CHECK_THAT(missing.problems[0], Catch::Contains("B.txt:3") && Catch::Contains("not in the") &&
                                        Catch::Contains("X.md:1"));

    const Report unbound = check("The forward's memory is not quoted here.");
    REQUIRE(unbound.problems.size() == 2);
    CHECK_THAT(unbound.problems[0], Catch::Contains("B.txt:2") && Catch::Contains("no paragraphs"));

    const Report commented = check_document(
        {"<!-- figures:", "-->", "At N = 2048 the forward takes 0 MiB."}, "X.md", bindings, "B.txt");
    REQUIRE(commented.problems.size() == 1);
    CHECK_THAT(commented.problems[0], Catch::Contains("X.md:1: a figures comment"));
}

// =============================================================================================
// [notes] NOTES.md must stay true to the code: every line it quotes from flash.cu (the fenced
// blocks that follow a `<!-- quoted from flash.cu -->` line) must still be a line of flash.cu.

TEST_CASE("Every line NOTES.md quotes from flash.cu is still in flash.cu", "[cpu][notes]") {
    const std::vector<std::string> notes = source_lines("NOTES.md");
    const std::vector<std::string> code = source_lines("flash.cu");
    int quoted = 0;
    for (size_t n = 0; n < notes.size(); ++n) {
        if (notes[n] != "<!-- quoted from flash.cu -->") continue;
        REQUIRE(n + 1 < notes.size());
        REQUIRE(notes[n + 1].rfind("```", 0) == 0);  // the fence must follow at once
        for (size_t k = n + 2; k < notes.size() && notes[k].rfind("```", 0) != 0; ++k) {
            if (notes[k].empty()) continue;
            ++quoted;
            INFO("NOTES.md:" << k + 1 << " quotes a line flash.cu no longer has:\n  " << notes[k]);
            CHECK(std::find(code.begin(), code.end(), notes[k]) != code.end());
        }
    }
    INFO("NOTES.md should quote the forward kernel");
    CHECK(quoted >= 30);
}

// =============================================================================================
// Files of the tree, read as they are (source_lines trims its lines; a hash must not)

namespace {

namespace fs = std::filesystem;

std::string file_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::ostringstream all;
    all << in.rdbuf();
    return all.str();
}

std::vector<std::string> text_lines(const std::string& text) {
    std::vector<std::string> lines = split(text, '\n');
    for (std::string& l : lines)
        if (!l.empty() && l.back() == '\r') l.pop_back();
    return lines;
}

// The regular files under dir (a path relative to the root), recursively, as relative paths,
// sorted; folders whose names start with '.' (build caches) or are __pycache__ are left out.
std::vector<std::string> files_under(const std::string& dir) {
    std::vector<std::string> out;
    if (!fs::is_directory(dir)) return out;
    for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator();
         ++it) {
        const std::string name = it->path().filename().string();
        if (it->is_directory() && (name[0] == '.' || name == "__pycache__")) {
            it.disable_recursion_pending();
            continue;
        }
        if (it->is_regular_file()) out.push_back(it->path().generic_string());
    }
    std::sort(out.begin(), out.end());
    return out;
}

// ---------------------------------------------------------------------------------------------
// [data] Every file in lab/data/ and lab/patches/ is cited, and every citation names a file.
//
// A citation is the file's path from the root, written out: lab/data/NAME or lab/patches/NAME
// (a name of letters, digits and . _ + -, not ending in a dot, so that a sentence may end after
// it). No globs, no bare data/NAME: a reader must be able to open what is named. The citing
// files: the documents at the root and every file under lab/ (but lab/data/ and lab/patches/
// themselves), bench/, .ci/ and pytorch/.

const std::regex kCitation("lab/(?:data|patches)/[A-Za-z0-9_.+-]*[A-Za-z0-9_+-]");
const std::vector<std::string> kCitedFolders = {"lab/data", "lab/patches"};

std::vector<std::string> citing_files() {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(".")) {
        const std::string name = e.path().filename().string();
        if (e.is_regular_file() &&
            (ends_with(name, ".md") || ends_with(name, ".cu") || ends_with(name, ".cpp") ||
             ends_with(name, ".h") || name == "Makefile"))
            out.push_back(name);
    }
    for (const std::string dir : {"lab", "bench", ".ci", "pytorch"})
        for (const std::string& f : files_under(dir))
            if (f.rfind("lab/data/", 0) != 0 && f.rfind("lab/patches/", 0) != 0) out.push_back(f);
    std::sort(out.begin(), out.end());
    return out;
}

struct Citations {
    std::map<std::string, std::string> cited;  // path -> the first "file:line" citing it
    std::vector<std::string> uncited;          // files nobody cites
    std::vector<std::string> missing;          // "file:line: path" cited but not there
};

// What the given files cite, against what the folders hold.
Citations citations(const std::vector<std::string>& citing,
                    const std::vector<std::string>& folders) {
    Citations c;
    for (const std::string& f : citing) {
        const std::vector<std::string> lines = text_lines(file_text(f));
        for (size_t n = 0; n < lines.size(); ++n)
            for (auto it = std::sregex_iterator(lines[n].begin(), lines[n].end(), kCitation);
                 it != std::sregex_iterator(); ++it)
                c.cited.emplace(it->str(), f + ":" + std::to_string(n + 1));
    }
    for (const auto& [path, where] : c.cited)
        if (!fs::is_regular_file(path)) c.missing.push_back(where + ": " + path);
    for (const std::string& dir : folders)
        for (const std::string& f : files_under(dir))
            if (!c.cited.count(f)) c.uncited.push_back(f);
    return c;
}

}  // namespace

TEST_CASE("Every data file is cited, and every citation names a file that exists", "[cpu][data]") {
    const Citations c = citations(citing_files(), kCitedFolders);
    for (const std::string& m : c.missing) FAIL_CHECK(m << " is cited but does not exist");
    std::string list;
    for (const std::string& f : c.uncited) list += "\n  " + f;
    INFO(c.uncited.size() << " files that no document or script cites (lab/uncited-data.sh lists "
                             "them; git rm them, or cite them):" << list);
    CHECK(c.uncited.empty());
    CHECK(c.cited.size() > 0);
}

// =============================================================================================
// [exercises] Every breakage exercise's outcome, as NOTES.md states it, is what its log says, and
// every log is current.
//
// exercises/C.N.patch is the exercise's edit; exercises/run.sh applies it to a copy of
// the tree on a GPU, runs the command its header names and writes exercises/C.N.log: '# '
// lines (the exercise, the patch, the command, the GPU, the sha1 of the sources it depends on),
// then the command's output. NOTES.md states the outcome in one line under the exercise:
//   Outcome on a GPU (`exercises/C.N.log`): F of T test cases fail, first "TEST CASE NAME".
// (with F = 0: `... 0 of T test cases fail.`), optionally followed by a ``` block of lines from
// the log. F and T are the log's Catch2 summary; the name, the first test case the log shows
// failing; every non-blank line of the block, trimmed, is text of the log.

namespace {

// SHA-1 (FIPS 180-4), to recompute the sources sha1 that exercises/run.sh writes with sha1sum.
std::string sha1_hex(const std::string& data) {
    uint32_t h[5] = {0x67452301u, 0xEFCDAB89u, 0x98BADCFEu, 0x10325476u, 0xC3D2E1F0u};
    std::string m = data;
    const uint64_t bits = uint64_t(data.size()) * 8;
    m += char(0x80);
    while (m.size() % 64 != 56) m += char(0);
    for (int k = 7; k >= 0; --k) m += char((bits >> (8 * k)) & 0xff);
    const auto rotl = [](uint32_t x, int s) { return (x << s) | (x >> (32 - s)); };
    for (size_t block = 0; block < m.size(); block += 64) {
        uint32_t w[80];
        for (int t = 0; t < 16; ++t)
            w[t] = uint32_t(uint8_t(m[block + 4 * t])) << 24 |
                   uint32_t(uint8_t(m[block + 4 * t + 1])) << 16 |
                   uint32_t(uint8_t(m[block + 4 * t + 2])) << 8 | uint8_t(m[block + 4 * t + 3]);
        for (int t = 16; t < 80; ++t) w[t] = rotl(w[t - 3] ^ w[t - 8] ^ w[t - 14] ^ w[t - 16], 1);
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
        for (int t = 0; t < 80; ++t) {
            const uint32_t f = t < 20 ? (b & c) | (~b & d)
                               : t < 40 ? b ^ c ^ d
                               : t < 60 ? (b & c) | (b & d) | (c & d)
                                        : b ^ c ^ d;
            const uint32_t k = t < 20 ? 0x5A827999u : t < 40 ? 0x6ED9EBA1u
                               : t < 60 ? 0x8F1BBCDCu : 0xCA62C1D6u;
            const uint32_t next = rotl(a, 5) + f + e + k + w[t];
            e = d, d = c, c = rotl(b, 30), b = a, a = next;
        }
        h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e;
    }
    std::ostringstream hex;
    for (uint32_t x : h) hex << std::hex << std::setw(8) << std::setfill('0') << x;
    return hex.str();
}

// The files exercise `id`'s log depends on, as exercises/run.sh lists them (sorted bytewise):
// its patch, the files the patch edits, and the tests but the documentation checks.
std::vector<std::string> exercise_sources(const std::string& id) {
    const std::string patch = "exercises/" + id + ".patch";
    std::set<std::string> files = {patch, "test_flash.cpp"};
    const std::regex edited("^diff --git a/(\\S+) b/");
    for (const std::string& line : text_lines(file_text(patch))) {
        std::smatch m;
        if (std::regex_search(line, m, edited)) files.insert(m[1]);
    }
    for (const std::string& f : files_under("tests"))
        if ((ends_with(f, ".cpp") || ends_with(f, ".h")) && f.find('/', 6) == std::string::npos &&
            f != "tests/test_docs.cpp")
            files.insert(f);
    return {files.begin(), files.end()};  // std::set orders std::string bytewise
}

// The sha1 of `sha1sum FILE...`'s output over exercise_sources(id), and the lines themselves.
std::string sources_sha1(const std::string& id, std::vector<std::string>* each = nullptr) {
    std::string listing;
    for (const std::string& f : exercise_sources(id)) {
        const std::string line = sha1_hex(file_text(f)) + "  " + f;
        if (each) each->push_back(line);
        listing += line + "\n";
    }
    return sha1_hex(listing);
}

// What a log says: its header, its Catch2 summary and its first failing test case.
struct LogFacts {
    std::map<std::string, std::string> header;  // "# name: value" lines; "source" lines apart
    std::vector<std::string> sources;           // "# source: HASH  PATH" lines
    std::string text;                           // the whole log
    int total = -1, failed = -1;                // the last Catch2 summary's test cases
    std::string first_failure;                  // the test case header (name and sections),
                                                // its lines joined by single spaces
    std::vector<std::string> table;             // "| PASS | name" / "| FAIL | name | first failure"
    int table_failed = 0;                       // its FAIL rows
};

std::string squeezed(const std::string& s) {  // runs of whitespace to one space, trimmed
    std::string out;
    for (char c : s) {
        if (std::isspace(static_cast<unsigned char>(c))) {
            if (!out.empty() && out.back() != ' ') out += ' ';
        } else {
            out += c;
        }
    }
    if (!out.empty() && out.back() == ' ') out.pop_back();
    return out;
}

bool is_rule(const std::string& line, char c) {  // Catch2's lines of 79 '-' (or '.')
    return line.size() >= 70 && line.find_first_not_of(c) == std::string::npos;
}

LogFacts read_log(const std::string& text) {
    LogFacts f;
    f.text = text;
    const std::vector<std::string> lines = text_lines(text);
    size_t n = 0;
    for (; n < lines.size() && lines[n].rfind("# ", 0) == 0; ++n) {
        const size_t colon = lines[n].find(": ");
        if (colon == std::string::npos) continue;
        const std::string name = lines[n].substr(2, colon - 2), value = lines[n].substr(colon + 2);
        if (name == "source") f.sources.push_back(value);
        else f.header.emplace(name, value);
    }
    for (size_t k = n; k < lines.size() && lines[k].rfind("| ", 0) == 0; ++k) {
        f.table.push_back(lines[k]);
        f.table_failed += lines[k].rfind("| FAIL | ", 0) == 0;
    }
    const std::regex all_passed("^All tests passed \\(\\d+ assertions? in (\\d+) test cases?\\)");
    for (size_t k = n; k < lines.size(); ++k) {
        std::smatch m;
        if (std::regex_search(lines[k], m, all_passed)) {
            f.total = std::stoi(m[1]), f.failed = 0;
        } else if (lines[k].rfind("test cases:", 0) == 0) {
            // "test cases: 25 | 21 passed | 4 failed": Catch2 leaves out a column that is 0
            const std::vector<std::string> cols = split(lines[k].substr(11), '|');
            f.total = std::atoi(trimmed(cols[0]).c_str()), f.failed = 0;
            for (size_t c = 1; c < cols.size(); ++c) {
                const std::string col = trimmed(cols[c]);
                if (ends_with(col, " failed")) f.failed = std::atoi(col.c_str());
            }
        }
    }
    // No Catch2 summary: a run the tests' deadline ended (a kernel that never finished) prints
    // only the suite's own line, "flash tests: P passed, F failed, S skipped".
    const std::regex own_line("^flash tests: (\\d+) passed, (\\d+) failed");
    for (size_t k = n; k < lines.size() && f.total < 0; ++k) {
        std::smatch m;
        if (std::regex_search(lines[k], m, own_line))
            f.total = std::stoi(m[1]) + std::stoi(m[2]), f.failed = std::stoi(m[2]);
    }
    // A test case's header: a rule of '-', its name (and sections), a rule; it failed if a
    // "FAILED:" comes before the next header.
    for (size_t k = n; k + 1 < lines.size() && f.first_failure.empty(); ++k) {
        if (!is_rule(lines[k], '-')) continue;
        size_t end = k + 1;
        while (end < lines.size() && !is_rule(lines[end], '-')) ++end;
        if (end >= lines.size()) break;
        std::string name;
        for (size_t h = k + 1; h < end; ++h) name += lines[h] + " ";
        size_t next = end + 1;
        while (next < lines.size() && !is_rule(lines[next], '-')) {
            if (lines[next].find("FAILED:") != std::string::npos) {
                f.first_failure = squeezed(name);
                break;
            }
            ++next;
        }
        k = next - 1;
    }
    // With a table, the first failure is its first FAIL row's test case (the output may be cut).
    for (const std::string& row : f.table) {
        if (row.rfind("| FAIL | ", 0) != 0) continue;
        const std::string rest = row.substr(9);
        f.first_failure = squeezed(rest.substr(0, rest.find(" | ")));
        break;
    }
    return f;
}

struct Outcome {
    std::string id;
    int failed = 0, total = 0;
    std::string first;           // "" when failed == 0
    std::vector<std::string> quoted;
    std::string where;           // NOTES.md:LINE
};

const std::regex kOutcome(
    "^Outcome on a GPU \\(`exercises/([0-9]+\\.[0-9]+)\\.log`\\): ([0-9]+) of ([0-9]+) test "
    "cases? fails?(?:, first \"(.+)\")?\\.$");

// The outcome lines of a document (its lines as they are); a line that starts like one but does
// not parse is a problem.
std::vector<Outcome> outcomes(const std::vector<std::string>& lines, const std::string& doc,
                              std::vector<std::string>* problems) {
    std::vector<Outcome> out;
    for (size_t n = 0; n < lines.size(); ++n) {
        const std::string line = trimmed(lines[n]);
        if (line.rfind("Outcome on a GPU", 0) != 0) continue;
        std::smatch m;
        if (!std::regex_match(line, m, kOutcome)) {
            problems->push_back(doc + ":" + std::to_string(n + 1) + ": not of the form "
                                "Outcome on a GPU (`exercises/C.N.log`): F of T test cases "
                                "fail, first \"NAME\".");
            continue;
        }
        Outcome o{m[1], std::stoi(m[2]), std::stoi(m[3]), m[4], {},
                  doc + ":" + std::to_string(n + 1)};
        size_t k = n + 1;
        while (k < lines.size() && trimmed(lines[k]).empty()) ++k;
        if (k < lines.size() && trimmed(lines[k]).rfind("```", 0) == 0)
            for (++k; k < lines.size() && trimmed(lines[k]).rfind("```", 0) != 0; ++k)
                if (!trimmed(lines[k]).empty()) o.quoted.push_back(trimmed(lines[k]));
        out.push_back(o);
    }
    return out;
}

// What is wrong with one outcome against its log's facts.
std::vector<std::string> outcome_problems(const Outcome& o, const LogFacts& log) {
    std::vector<std::string> p;
    const std::string at = o.where + ": exercise " + o.id + ": ";
    if (log.total < 0) {
        p.push_back(at + "its log has no Catch2 summary (\"test cases: ...\" or \"All tests "
                    "passed\"): the run did not finish; see the log's exit status");
        return p;
    }
    if (o.failed != log.failed || o.total != log.total)
        p.push_back(at + "says " + std::to_string(o.failed) + " of " + std::to_string(o.total) +
                    " test cases fail; the log: " + std::to_string(log.failed) + " of " +
                    std::to_string(log.total));
    const std::string first = squeezed(o.first);
    const std::string& got = log.first_failure;
    if (o.failed > 0 && (got.compare(0, first.size(), first) != 0 ||
                         (got.size() > first.size() && got[first.size()] != ' ')))
        p.push_back(at + "says the first failing test case is \"" + o.first + "\"; the log: \"" +
                    (got.empty() ? "(none)" : got) + "\"");
    for (const std::string& q : o.quoted)
        if (log.text.find(q) == std::string::npos)
            p.push_back(at + "quotes a line its log does not have: " + q);
    return p;
}

std::string exercise_id(const std::string& path) {  // exercises/1.10.log -> 1.10
    const std::string name = fs::path(path).filename().string();
    return name.substr(0, name.rfind('.'));
}

// The ids of the exercises' files that end in `suffix` (".patch", ".log"): exercises/1.10.log -> 1.10.
std::set<std::string> exercise_ids(const std::string& suffix) {
    std::set<std::string> ids;
    for (const std::string& f : files_under("exercises"))
        if (ends_with(f, suffix)) ids.insert(exercise_id(f));
    return ids;
}

}  // namespace

TEST_CASE("Every exercise has a log with its table, and NOTES.md states what the log shows",
          "[cpu][exercises]") {
    std::vector<std::string> problems;
    const std::set<std::string> patches = exercise_ids(".patch"), logs = exercise_ids(".log");
    REQUIRE(!patches.empty());
    const std::vector<Outcome> stated =
        outcomes(text_lines(file_text("NOTES.md")), "NOTES.md", &problems);
    std::set<std::string> in_notes;
    for (const Outcome& o : stated) {
        in_notes.insert(o.id);
        if (!logs.count(o.id)) {
            problems.push_back(o.where + ": exercises/" + o.id + ".log does not exist");
            continue;
        }
        const LogFacts log = read_log(file_text("exercises/" + o.id + ".log"));
        for (const std::string& p : outcome_problems(o, log)) problems.push_back(p);
    }
    std::string missing;
    for (const std::string& id : patches) {
        if (!logs.count(id)) missing += " " + id;
    }
    if (!missing.empty())
        problems.push_back("no log for exercise" + missing + ": run exercises/run.sh on a GPU "
                           "(from the root: CPPFLAGS=-I<Catch2's include dir> exercises/run.sh)");
    for (const std::string& id : logs) {
        const std::string log_path = "exercises/" + id + ".log";
        if (!patches.count(id)) problems.push_back(log_path + " has no patch (exercises/" + id +
                                                   ".patch)");
        if (!in_notes.count(id))
            problems.push_back(log_path + ": NOTES.md has no line \"Outcome on a GPU (`" +
                               log_path + "`): ...\"");
        if (!patches.count(id)) continue;
        const LogFacts log = read_log(file_text(log_path));
        // The table: one row a test case the command selected, as many as the run's summary
        // counts, its FAIL rows as many as it says failed.
        if (log.table.empty()) {
            problems.push_back(log_path + " has no table of its test cases (exercises/run.sh "
                               "writes one): run exercises/run.sh " + id + " on a GPU");
        } else if (int(log.table.size()) != log.total || log.table_failed != log.failed) {
            problems.push_back(log_path + "'s table has " + std::to_string(log.table.size()) +
                               " rows, " + std::to_string(log.table_failed) + " FAIL; its run " +
                               "counted " + std::to_string(log.total) + " test cases, " +
                               std::to_string(log.failed) + " failed");
        }
    }
    for (const std::string& p : problems) FAIL_CHECK(p);
}

// The maintainer's check (make check-exercises; hidden from make check, which a student runs with
// an exercise applied): every log is still current with the files it ran, by their SHA-1s.
TEST_CASE("Every exercise log is current with the sources it ran", "[.freshness]") {
    std::vector<std::string> problems;
    const std::set<std::string> patches = exercise_ids(".patch"), logs = exercise_ids(".log");
    REQUIRE(!logs.empty());
    for (const std::string& id : logs) {
        if (!patches.count(id)) continue;
        const std::string log_path = "exercises/" + id + ".log";
        const LogFacts log = read_log(file_text(log_path));
        std::vector<std::string> now;
        const std::string sum = sources_sha1(id, &now);
        const auto written = log.header.find("sources sha1");
        if (written != log.header.end() && written->second == sum) continue;
        std::string changed;
        for (const std::string& line : now)
            if (std::find(log.sources.begin(), log.sources.end(), line) == log.sources.end())
                changed += " " + line.substr(line.find("  ") + 2);
        problems.push_back(log_path + " is older than its sources (changed since:" +
                           (changed.empty() ? std::string(" the list of files") : changed) +
                           "): run exercises/run.sh " + id + " on a GPU");
    }
    for (const std::string& p : problems) FAIL_CHECK(p);
}

// The checks above must be able to fail: a log and outcome lines made up here, each wrong in one
// way, and SHA-1 against FIPS 180-4's own examples.
TEST_CASE("The exercise check reads Catch2's output and finds each disagreement",
          "[cpu][exercises]") {
    CHECK(sha1_hex("abc") == "a9993e364706816aba3e25717850c26c9cd0d89d");
    CHECK(sha1_hex("") == "da39a3ee5e6b4b0d3255bfef95601890afd80709");
    CHECK(sha1_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
          "84983e441c3bd26ebaae4aa1f95129e5e54670f1");
    const std::string rule(79, '-'), dots(79, '.');
    const std::string text =
        "# exercise 9.9: a made-up one\n# sources sha1: 0123\n# source: ab  flash.cu\n"
        "CUDA device 0: a GPU\n" + rule + "\nA test that warns\n" + rule + "\nx.cpp:1\n" + dots +
        "\n\nx.cpp:2: warning:\n  careful\n\n" + rule + "\nThe forward matches the reference\n"
        "  over a grid of shapes - fp16\n" + rule + "\nx.cpp:3\n" + dots + "\n\nx.cpp:4: FAILED:\n"
        "  CHECK( nans == 0 )\nwith expansion:\n  3 == 0\n\n" + std::string(79, '=') +
        "\ntest cases: 25 | 21 passed | 4 failed\nassertions: 90 | 80 passed | 10 failed\n";
    const LogFacts log = read_log(text);
    CHECK(log.header.at("sources sha1") == "0123");
    CHECK(log.sources == std::vector<std::string>{"ab  flash.cu"});
    CHECK(log.total == 25);
    CHECK(log.failed == 4);
    CHECK(log.first_failure == "The forward matches the reference over a grid of shapes - fp16");

    const auto lines_of = [](const std::string& outcome, const std::string& quote) {
        return std::vector<std::string>{"1. **An exercise.** Edit a line.", "   " + outcome, "",
                                        "   ```", "   " + quote, "   ```"};
    };
    const std::string good = "Outcome on a GPU (`exercises/9.9.log`): 4 of 25 test cases "
                             "fail, first \"The forward matches the reference over a grid of "
                             "shapes\".";
    std::vector<std::string> problems;
    std::vector<Outcome> o = outcomes(lines_of(good, "CHECK( nans == 0 )"), "X.md", &problems);
    REQUIRE(o.size() == 1);
    CHECK(problems.empty());
    CHECK(outcome_problems(o[0], log).empty());

    std::string wrong_count = good;
    wrong_count.replace(wrong_count.find("4 of"), 4, "5 of");
    o = outcomes(lines_of(wrong_count, "3 == 0"), "X.md", &problems);
    REQUIRE(o.size() == 1);
    REQUIRE(outcome_problems(o[0], log).size() == 1);
    CHECK_THAT(outcome_problems(o[0], log)[0], Catch::Contains("X.md:2") &&
                                                   Catch::Contains("the log: 4 of 25"));

    std::string wrong_first = good;
    wrong_first.replace(wrong_first.find("forward"), 7, "backward");
    o = outcomes(lines_of(wrong_first, "CHECK( nans == 1 )"), "X.md", &problems);
    REQUIRE(o.size() == 1);
    CHECK(outcome_problems(o[0], log).size() == 2);  // the name, and the quote

    std::string prefix_only = good;  // "The forward" is a name's start, not a word of it
    prefix_only.replace(prefix_only.find(" matches the reference over a grid of shapes"), 44, "");
    o = outcomes(lines_of(prefix_only.replace(prefix_only.find("forward"), 7, "forw"), "3 == 0"),
                 "X.md", &problems);
    REQUIRE(o.size() == 1);
    CHECK(outcome_problems(o[0], log).size() == 1);

    o = outcomes({"Outcome on a GPU (exercises/9.9.log): four fail."}, "X.md", &problems);
    CHECK(o.empty());
    REQUIRE(problems.size() == 1);
    CHECK_THAT(problems[0], Catch::Contains("X.md:1: not of the form"));

    const LogFacts unfinished = read_log("# exit status: 124\n" + rule + "\nA test\n" + rule +
                                         "\nx.cpp:1\n");
    Outcome zero{"9.9", 0, 1, "", {}, "X.md:1"};
    REQUIRE(outcome_problems(zero, unfinished).size() == 1);
    CHECK_THAT(outcome_problems(zero, unfinished)[0], Catch::Contains("no Catch2 summary"));
    CHECK(outcome_problems(zero, read_log("All tests passed (3 assertions in 1 test case)\n"))
              .empty());
}

// The citation check on a folder of its own: a cited file, an uncited one, a citation of a file
// that is not there, a sentence's full stop after a citation.
TEST_CASE("The data check finds uncited files and citations of missing ones", "[cpu][data]") {
    const fs::path dir = fs::temp_directory_path() / ("check_docs_" + std::to_string(::getpid()));
    fs::create_directories(dir / "lab/data");
    const fs::path before = fs::current_path();
    fs::current_path(dir);
    std::ofstream("lab/data/kept.csv") << "a,b\n";
    std::ofstream("lab/data/stray.txt") << "x\n";
    std::ofstream("doc.md") << "See lab/data/kept.csv.\nAnd lab/data/gone.txt, once.\n";
    const Citations c = citations({"doc.md"}, {"lab/data"});
    fs::current_path(before);
    fs::remove_all(dir);
    CHECK(c.cited.count("lab/data/kept.csv") == 1);
    CHECK(c.uncited == std::vector<std::string>{"lab/data/stray.txt"});
    CHECK(c.missing == std::vector<std::string>{"doc.md:2: lab/data/gone.txt"});
}
